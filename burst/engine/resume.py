"""Training checkpoints with torch.distributed.checkpoint (DCP), and exact resume.

    DIR/step-K/            written after K steps (--checkpoint-every); --keep N keeps the N newest
        *.distcp, .metadata  model and AdamW state, sharded as each rank holds it (FSDP2 or not);
                             DCP reshards on load, so a run may resume on another world or FSDP mode
        burst.json           the step, the TrainConfig, the model preset's shape, the other files' digests
        rng-R.pt             rank R's torch RNG state

The learning-rate schedule is a function of the step and the data of the seed and the step (the
data position is the step), so model, optimizer, step and RNG make the resumed run's later losses
equal the uninterrupted run's (tests/test_engine.py).

burst.json is written last and atomically, so a save killed at any point leaves a directory that is
never taken for a checkpoint (and is deleted by the next complete save). `--resume` picks the latest
complete checkpoint, or starts fresh where there is none: the command to repeat after any failure,
e.g. under `torchrun --max-restarts N`.

A checkpoint from another config (another model, sequence length, global batch, data, seed or
schedule) is refused before training starts, naming the field. burst.json keeps a digest of every other
file (each rank reads its share back once after a save), checked before a load: a shard damaged after it
was written is refused by name instead of loading as wrong or NaN weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict

import torch
import torch.distributed as dist

from ..comm.membership import group_rank, group_size

# Fields that change what the resumed steps compute; the rest (world, strategy, layout, dp/FSDP,
# checkpointing, metrics) may differ between the two runs.
MUST_MATCH = ("model", "seq_len", "global_batch", "data", "seed", "lr", "warmup", "steps", "weight_decay", "fused_loss")


META = "burst.json"  # written last: a step directory holding it is complete


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step}")


def complete_steps(root: str) -> list[int]:
    """The steps of the complete checkpoints under `root` (those whose burst.json was written), rising."""
    return sorted(step for step, complete in _step_dirs(root) if complete)


def _step_dirs(root: str) -> list[tuple[int, bool]]:
    """(step, complete) of every step-K directory under `root`."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        number = name.removeprefix("step-")
        if name.startswith("step-") and number.isdigit():
            out.append((int(number), os.path.exists(os.path.join(root, name, META))))
    return out


def latest_step(root: str) -> int:
    """The last complete checkpoint's step under `root`; ValueError when there is none."""
    steps = complete_steps(root)
    if not steps:
        raise ValueError(f"no complete checkpoint in {root!r}")
    return steps[-1]


def resume_point(root: str | None) -> int | None:
    """--resume: the latest complete checkpoint's step under `root`, or None (start fresh) when there is
    none. A checkpoint a killed save left without its burst.json is never taken."""
    steps = complete_steps(root) if root else []
    return steps[-1] if steps else None


def prune(root: str, newest: int, keep: int) -> list[str]:
    """After checkpoint `newest` is complete: delete the complete checkpoints older than the `keep`
    newest (keep 0: none) and the incomplete ones older than `newest` (what a killed save left).
    Returns the deleted paths."""
    import shutil

    complete = complete_steps(root)
    doomed = [s for s in complete[:-keep]] if keep else []
    doomed += [s for s, done in _step_dirs(root) if not done and s < newest]
    for step in doomed:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
    return [step_dir(root, s) for s in doomed]


def read_meta(root: str, step: int) -> dict:
    """burst.json of the checkpoint after `step` steps: step, identity, config. ValueError naming the file
    when it is missing or not one `burst train` wrote."""
    path = os.path.join(step_dir(root, step), META)
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"no checkpoint for step {step} in {root!r} ({path} is missing)") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} cannot be read as a burst checkpoint's record: {err}") from None
    if not (isinstance(meta, dict) and isinstance(meta.get("identity"), dict) and isinstance(meta.get("config"), dict)):
        raise ValueError(f"{path} is not a burst checkpoint's record (no identity and config in it)")
    return meta


def _identity(cfg) -> dict:
    values = asdict(cfg)
    values["global_batch"] = cfg.batch * cfg.dp
    values["data"] = data_fingerprint(cfg.data)
    return {key: values[key] for key in MUST_MATCH}


_FINGERPRINT = "file of "  # how a data file's fingerprint starts (a checkpoint before 0.3.11 kept the --data text)
_SAMPLE_BYTES, _SAMPLES, _WHOLE_BELOW = 1 << 16, 32, 64 << 20


def data_fingerprint(data: str) -> str:
    """What a checkpoint keeps of --data: "synthetic", or the file's size and a digest of its contents (the whole
    file up to 64 MiB; beyond, 32 evenly spaced places of 64 KiB, the first and last bytes included).
    The path is not kept: a run resumed from another directory, or with the file moved, finds the same data,
    and a file edited or replaced under the same name is refused."""
    if data == "synthetic" or not os.path.isfile(data):
        return data
    import hashlib

    size = os.path.getsize(data)
    digest = hashlib.blake2b(digest_size=8)
    last = max(size - _SAMPLE_BYTES, 0)
    with open(data, "rb") as f:
        if size <= _WHOLE_BELOW:
            digest.update(f.read())
        else:
            for offset in sorted({last * i // (_SAMPLES - 1) for i in range(_SAMPLES)}):
                f.seek(offset)
                digest.update(f.read(_SAMPLE_BYTES))
    return f"{_FINGERPRINT}{size} bytes, digest {digest.hexdigest()}"


def _differs(key: str, saved, mine, cfg) -> bool:
    if key == "data" and isinstance(saved, str) and not saved.startswith(_FINGERPRINT) and saved != "synthetic":
        return saved != cfg.data  # a checkpoint of 0.3.10 or before: the --data text
    return saved != mine


def check_resumable(cfg) -> None:
    """Raise ValueError if --resume-step cannot be honoured (runs before any process starts)."""
    if not cfg.checkpoint_dir:
        raise ValueError("--resume-step: needs --checkpoint-dir (where the checkpoints are)")
    if not 0 < cfg.resume_step <= cfg.steps:
        raise ValueError(f"--resume-step: {cfg.resume_step} must lie in 1..--steps ({cfg.steps})")
    if not os.path.exists(os.path.join(step_dir(cfg.checkpoint_dir, cfg.resume_step), META)):
        have = [
            f"step-{step}" + ("" if complete else " (incomplete: a save that did not finish)")
            for step, complete in sorted(_step_dirs(cfg.checkpoint_dir))
        ]
        raise ValueError(
            f"--resume-step: no complete checkpoint for step {cfg.resume_step} in {cfg.checkpoint_dir!r} "
            f"(found: {', '.join(have) or 'none'})"
        )
    try:
        saved = read_meta(cfg.checkpoint_dir, cfg.resume_step)["identity"]
    except ValueError as err:
        raise ValueError(f"--resume-step: {err}") from None
    mine = _identity(cfg)
    for key in MUST_MATCH:
        if _differs(key, saved.get(key), mine[key], cfg):
            shown = f"{mine[key]!r} (--data {cfg.data!r})" if key == "data" else repr(mine[key])
            raise ValueError(
                f"--resume-step: the checkpoint in {cfg.checkpoint_dir!r} is from another config: "
                f"{key} was {saved.get(key)!r}, this run has {shown}"
            )


def save_checkpoint(cfg, step: int, model, optimizer) -> str:
    """Model, optimizer, step, config and RNG after `step` steps; a collective over the world."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = step_dir(cfg.checkpoint_dir, step)
    _empty_step_dir(path, step)
    model_state, optim_state = get_state_dict(model, optimizer)
    with named_failure(f"saving step {step}'s checkpoint to {path!r}", writes_to=path):
        dcp.save(
            {"model": model_state, "optimizer": optim_state}, checkpoint_id=path, no_dist=not dist.is_initialized()
        )
    rank = group_rank()
    torch.save(torch.get_rng_state(), os.path.join(path, f"rng-{rank}.pt"))
    if dist.is_initialized():
        dist.barrier()  # every rank's files are written before META marks the step complete
    files = file_digests(path)
    if rank == 0:
        partial = os.path.join(path, META + ".partial")
        with open(partial, "w") as f:
            meta = {"step": step, "identity": _identity(cfg), "config": asdict(cfg), "files": files}
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, os.path.join(path, META))  # atomic: a complete burst.json or none
        prune(cfg.checkpoint_dir, step, cfg.keep)
    if dist.is_initialized():
        dist.barrier()  # and META exists on return, on every rank
    return path


def _empty_step_dir(path: str, step: int) -> None:
    """A step saved again (a run resumed from an earlier step reaches it again) starts from nothing: its old
    burst.json goes first, then the rest. Written over in place, the old step had kept its burst.json while its
    files changed, so a save killed midway left it taken for complete, refused as damaged at every --resume
    (step 2 intact beside it); and a file of the old save no new one replaces (another world's rng-R.pt) was
    counted among the new one's. A collective: every rank waits for the folder to be gone, and raises if rank 0
    could not remove it (on rank 0 alone, its peers would have waited in the next collective)."""
    problem = None
    if group_rank() == 0 and os.path.isdir(path):
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(path, META))
            shutil.rmtree(path)
        except OSError as err:
            problem = f"{type(err).__name__}: {err}"
    if dist.is_initialized():
        said = [problem]
        dist.broadcast_object_list(said, src=0)
        problem = said[0]
    if problem is not None:
        raise RuntimeError(
            f"saving step {step}'s checkpoint to {path!r} failed: its earlier save is not removed ({problem})"
        )


@contextlib.contextmanager
def named_failure(what: str, writes_to: str | None = None):
    """DCP's failures as one RuntimeError that names `what` and the first rank's own error: DCP raises a
    CheckpointException (a BaseException, which `except Exception` misses) that says only "ranks:
    dict_keys([0, 1])". writes_to: a save's folder, whose filesystem's free space the error adds."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - any failure, named
        raise RuntimeError(f"{what} failed: {_first_failure(err)}{space_left(writes_to)}") from err


def space_left(path: str | None) -> str:
    """' (N MiB free on the filesystem holding it...)' for a failed save, '' without a path: a full disk shows,
    which torch's writer reports only as a short write ("unexpected pos")."""
    if path is None:
        return ""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return ""
    full = ": is it full?" if free < FULL_BELOW else ""
    return f" ({free / 2**20:.1f} MiB free on the filesystem holding it{full})"


FULL_BELOW = 256 * 2**20  # free bytes under which a failed save asks whether the disk is full


@contextlib.contextmanager
def _quiet_loader():
    """DCP's loader logs each fallback it tries (no .metadata: the ranks' own) with a traceback, on the
    root logger: off while it runs, since named_failure says in one line what failed."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def _first_failure(err: BaseException) -> str:
    """The first rank's own error inside DCP's CheckpointException ("CheckpointException ranks:dict_keys(
    [0, 1])" says nothing of it), else the error itself."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = min(failures.items())
        inner = getattr(failure, "exc", failure)
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            inner = inner[0]  # DCP's (exception, its traceback's frames)
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return f"{type(err).__name__}: {err}"


def file_digests(path: str) -> dict[str, str]:
    """{name: blake2b digest} of the checkpoint's files (burst.json aside), the same on every rank: each rank reads
    its share of them (the files of all ranks are on one filesystem, as DCP's resharding needs), then one
    all_gather_object. A collective over the world."""
    names = sorted(n for n in os.listdir(path) if not n.startswith(META))
    mine = {n: _digest(os.path.join(path, n)) for n in names[group_rank() :: group_size()]}
    if not dist.is_initialized():
        return mine
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, mine)
    return {n: d for share in shares for n, d in sorted(share.items())}


def _digest(file: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(file, "rb") as f:
        while block := f.read(_READ_BYTES):
            h.update(block)
    return h.hexdigest()


_READ_BYTES = 16 * 2**20


def check_files(checkpoint_dir: str, step: int) -> None:
    """ValueError on every rank naming the checkpoint's files whose bytes are not what was saved (a damaged
    disk or copy: DCP reads such a shard without a word, and the weights come back wrong or NaN), or that are
    missing. A checkpoint written before burst kept digests (no "files" in burst.json) is not checked."""
    saved = read_meta(checkpoint_dir, step).get("files")
    if saved is None:
        return
    path = step_dir(checkpoint_dir, step)
    found = file_digests(path)
    bad = sorted(n for n in saved if found.get(n) != saved[n])
    if bad:
        missing = [n for n in bad if n not in found]
        raise ValueError(
            f"the checkpoint {path!r} is damaged: {', '.join(bad)} "
            + (f"(missing: {', '.join(missing)}) " if missing else "")
            + ("differs" if len(bad) == 1 else "differ")
            + " from what was saved (the digests in burst.json); resume from another step (--resume-step)"
        )


def load_checkpoint(cfg, model, optimizer) -> int:
    """Load cfg.resume_step's checkpoint into model and optimizer (in place), its files checked first; returns
    that step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    check_files(cfg.checkpoint_dir, cfg.resume_step)
    path = step_dir(cfg.checkpoint_dir, cfg.resume_step)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    with named_failure(f"loading the checkpoint {path!r}"), _quiet_loader():
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    rank = group_rank()
    rng = os.path.join(path, f"rng-{rank}.pt")
    if os.path.exists(rng):  # a world larger than the saving one: new ranks keep their seeded state
        with named_failure(f"loading the random state {rng!r}"):
            torch.set_rng_state(torch.load(rng, weights_only=True))
    return cfg.resume_step


def load_model_weights(checkpoint_dir: str, step: int | None, model) -> int:
    """Only the model's weights from a `burst train` checkpoint (the latest step when None), for
    inference; returns the step loaded. Works in one process or in any world."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    step = latest_step(checkpoint_dir) if step is None else step
    check_files(checkpoint_dir, step)
    state = {"model": get_model_state_dict(model)}
    with named_failure(f"loading the checkpoint {step_dir(checkpoint_dir, step)!r}"), _quiet_loader():
        dcp.load(state, checkpoint_id=step_dir(checkpoint_dir, step), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])
    return step


def checkpoint_model_name(checkpoint_dir: str, step: int | None = None) -> str:
    """The model preset a checkpoint was trained with (so `burst generate` builds the right one)."""
    step = latest_step(checkpoint_dir) if step is None else step
    model = read_meta(checkpoint_dir, step)["config"].get("model")
    if not isinstance(model, str):
        raise ValueError(f"the checkpoint of step {step} in {checkpoint_dir!r} names no model")
    return model
