"""The generation zoo: every causal-LM family transformers ships, built tiny from its own config (as the
forward zoo builds it: burst/bench/hf_zoo.py), generating on burst's sharded KV cache against the same
model's eager attention generating in one process.

For each family: a prompt of PROMPT tokens (not a multiple of the split: padded by the cache), NEW new
tokens, greedy (`do_sample=False`, no eos, so the length is fixed), `output_logits=True`. The reference is
the eager model's own `generate()` (its own default cache); the burst model has the same weights on
`bt.register(..., layout=LAYOUT)` over the world and runs `generate(ids, **bt.sharded_cache(model))` on every
rank. Each family ends in one of:
  exact    the same tokens on every rank and as the reference, every step's logits bit-identical on every
           rank and within TOLERANCE of the reference's (max |x - ref| / max |ref|, tests/cases.rel_err)
  refused  a ValueError / NotImplementedError raised inside burst, or transformers' own refusal to build
           the family on a custom attention implementation (its first line)
  skip     the family cannot be built tiny, or its eager model does not generate from token ids alone
  silent   ran and differs (tokens or logits, or the ranks disagree): the bug class this hunts
  crash    any other exception, a rank that timed out or died, or ranks that disagree on the outcome

    from burst.bench.hf_zoo_generate import run_zoo, table
    rows = run_zoo()            # {family: Outcome}, launching local worlds of 2 ranks itself

run_zoo runs the families in one world of `nproc` processes (gloo) and starts a new world for the rest
after a world ends early: a family that hangs (a watchdog ends its rank after FAMILY_SECONDS) or leaves the
process group unusable (burst's agreement timeout) is a crash, and the others still run.
benchmarks/hf_zoo_generate.py writes the table. A tool for the benchmarks, not part of the library.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist

from ..kernels.reference import relative_error
from .hf_zoo import (  # noqa: F401 (families)
    Outcome,
    _first_line,
    _NotBuilt,
    _raised_by_burst,
    _RefusedByBurst,
    _Skip,
    build_with,
    families,
)
from .hf_zoo_configs import VOCAB

PROMPT, NEW = 13, 6  # 13: not a multiple of 2 ranks x zigzag's 2 chunks (padded to 16)
TOLERANCE = 1e-4  # relative, as tests/test_transformers_generate.py holds generate()
LAYOUT = "zigzag"
FAMILY_SECONDS = 150  # a family still running after this (a hang) ends its world: crash
AGREEMENT_SECONDS = 60  # burst's agreement timeout in the ranks: a rank left waiting raises before the watchdog
SEVERITY = ("exact", "skip", "refused", "silent", "crash")


def prompt(length: int = PROMPT) -> torch.Tensor:
    """(1, length) token ids, the same on every rank (3..VOCAB: no pad, bos or eos id of the tiny configs)."""
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(0))


def generate(model, ids: torch.Tensor, cache=None, new: int = NEW) -> tuple[torch.Tensor, torch.Tensor]:
    """(the `new` new tokens (1, new), every step's logits (new, 1, vocab) in float32) of greedy generate();
    on `cache` where given (a ShardedCache), else on the model's own default cache."""
    from ..integrations.transformers.keywords import generate_cache_keyword

    extra = {generate_cache_keyword(model): cache} if cache is not None else {}
    out = model.generate(
        ids,
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        eos_token_id=None,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
        **extra,
    )
    tokens = out.sequences[:, ids.shape[1] :]
    if tokens.shape[1] != new or len(out.logits) != new:
        raise RuntimeError(f"generate() returned {tokens.shape[1]} new tokens and {len(out.logits)} logits, not {new}")
    return tokens, torch.stack(out.logits).float()


def build(model_type: str, name: str, ids: torch.Tensor, new: int = NEW):
    """(the eager model's (tokens, logits), the same weights on `name`, the eager model): hf_zoo's rules
    (hf_zoo.build_with), the eager model run for its generate()."""

    def reference(eager):
        with torch.no_grad():
            return generate(eager, ids, new=new)

    return build_with(model_type, name, reference)


def run_family(model_type: str, name: str, length: int = PROMPT, new: int = NEW) -> dict:
    """One family on the registered burst backend `name`, a prompt of `length` tokens and `new` new ones,
    on this rank: {outcome, detail, difference, tokens, logits, traceback} (tokens and logits: what the
    burst model generated on this rank, for the ranks' comparison; traceback: a crash's, for the log)."""
    ids = prompt(length)
    result = {"outcome": "", "detail": "", "difference": None, "tokens": None, "logits": None, "traceback": ""}
    try:
        (ref_tokens, ref_logits), model, eager = build(model_type, name, ids, new)
    except _Skip as err:
        return {**result, "outcome": "skip", "detail": str(err)}
    except _RefusedByBurst as err:
        return {**result, "outcome": "refused", "detail": str(err)}
    except _NotBuilt as err:
        return {**result, "outcome": "refused", "detail": f"by transformers, at from_config: {err}"}
    except Exception as err:  # noqa: BLE001 - any failure to build or generate eagerly is the family's
        detail = f"eager model does not generate tiny from token ids: {_first_line(err)}"
        return {**result, "outcome": "skip", "detail": detail, "traceback": traceback.format_exc()}
    from ..integrations import transformers as bt

    try:
        with torch.no_grad():
            tokens, logits = generate(model, ids, bt.ShardedCache(model), new)
    except TimeoutError as err:  # burst's agreement timeout: the ranks diverged (the group is unusable now)
        return {**result, "outcome": "crash", "detail": _first_line(err), "traceback": traceback.format_exc()}
    except Exception as err:  # noqa: BLE001 - burst's own clear refusal, or a crash
        kind = "refused" if _raised_by_burst(err) else "crash"
        detail = _first_line(err) + ("" if kind == "refused" else f" ({_where(err)})")
        return {**result, "outcome": kind, "detail": detail, "traceback": traceback.format_exc()}
    result.update(tokens=tokens, logits=logits)
    if logits.shape != ref_logits.shape:
        detail = f"logits of shape {tuple(logits.shape)}, the reference's {tuple(ref_logits.shape)}"
        return {**result, "outcome": "silent", "detail": detail}
    steps = [_relative(logits[i], ref_logits[i]) for i in range(new)]
    difference = max(steps)
    same = torch.equal(tokens, ref_tokens)
    if same and difference < TOLERANCE:
        return {**result, "outcome": "exact", "difference": difference}
    parts = []
    if not same:
        first = int((tokens != ref_tokens).flatten().nonzero()[0])
        parts.append(f"tokens differ from new token {first} on ({tokens.tolist()[0]} vs {ref_tokens.tolist()[0]})")
    parts.append(f"logits off by {difference:.2e} (relative; per step: {', '.join(f'{e:.1e}' for e in steps)})")
    detail = "; ".join(parts) + _control(eager, ids, ref_tokens, ref_logits)
    return {**result, "outcome": "silent", "detail": detail, "difference": difference}


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    """relative_error over the finite logits (a family may mask some to -inf); inf where either is not
    finite where the other is."""
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(x), finite):
        return float("inf")
    if not finite.any():
        return 0.0
    return relative_error(x[finite], ref[finite].double())


def _control(eager, ids, ref_tokens, ref_logits) -> str:
    """A silent outcome's control: the eager model's one forward (no cache) over the prompt and the
    reference's tokens, against the reference's generate() logits. Where those differ, the family's own
    cached generate() disagrees with its own forward (the reference itself is in question)."""
    try:
        with torch.no_grad():
            whole = eager(input_ids=torch.cat([ids, ref_tokens], dim=1), use_cache=False).logits.float()
    except Exception as err:  # noqa: BLE001 - no control
        return f"; no control (its forward without a cache: {_first_line(err)})"
    length, new = ids.shape[1], ref_tokens.shape[1]
    steps = whole[:, length - 1 : length - 1 + new].transpose(0, 1)  # (new, 1, vocab): each step's logits
    error = _relative(steps, ref_logits)
    if error < TOLERANCE:
        return f"; eager's own forward without a cache agrees with its generate() ({error:.1e})"
    return f"; eager's own forward without a cache differs from its generate() too, by {error:.2e}"


def _where(err: BaseException) -> str:
    """The innermost frame of err's traceback, as `file:line in function` (the file relative to its package)."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return "no traceback"
    frame = frames[-1]
    path = frame.filename
    for root in ("site-packages" + os.sep, os.sep + "burst" + os.sep):
        if root in path:
            path = path.split(root, 1)[1] if root.startswith("site") else "burst/" + path.split(root, 1)[1]
            break
    return f"at {path}:{frame.lineno} in {frame.name}"


def merge(family: str, per_rank: list[dict]) -> Outcome:
    """The family's Outcome from every rank's run_family: rank 0's when every rank agrees (and, where it
    ran, every rank generated the same tokens and bit-identical logits), else the most severe, naming the
    ranks'."""
    kinds = [r["outcome"] for r in per_rank]
    first = per_rank[0]
    if len(set(kinds)) > 1:
        worst = max(kinds, key=SEVERITY.index)
        worst = "crash" if worst in ("exact", "skip", "refused") else worst  # one rank refusing alone: a bug
        ranks = "; ".join(f"rank {i}: {r['outcome']} {r['detail']}".strip() for i, r in enumerate(per_rank))
        return Outcome(family, worst, f"the ranks disagree: {ranks}")
    if first["tokens"] is not None:
        for i, r in enumerate(per_rank[1:], 1):
            if not torch.equal(r["tokens"], first["tokens"]) or not torch.equal(r["logits"], first["logits"]):
                differ = (r["logits"].double() - first["logits"].double()).abs().max().item()
                detail = f"rank {i} generated other tokens or logits than rank 0 (logits by {differ:.2e})"
                detail += f"; rank 0: {first['outcome']} {first['detail']}".rstrip()
                return Outcome(family, "silent", detail)
    return Outcome(family, first["outcome"], first["detail"], first["difference"])


def zoo_world(
    rank: int, world: int, model_types: list[str], folder: str, family_seconds: float, lengths=(PROMPT, NEW)
) -> int:
    """Every family of model_types on this rank of a local world (burst.launch.spawn_world): each rank
    appends `rank{R}.jsonl` in `folder` (a start line before each family, its result after it) and rank 0
    appends `merged.jsonl` (each family's merged Outcome). A family that runs past family_seconds ends this
    rank (exit 124: its world ends), and one that leaves the group unusable ends the world too (run_zoo
    starts a new one for the families left). Returns the number of families done."""
    import warnings

    import transformers

    from ..integrations import transformers as bt

    transformers.logging.set_verbosity_error()  # tiny configs trip many of the families' own warnings
    warnings.filterwarnings("ignore")
    name = bt.register("zoo_generate_" + LAYOUT, layout=LAYOUT)
    mine = open(os.path.join(folder, f"rank{rank}.jsonl"), "a", buffering=1)
    merged = open(os.path.join(folder, "merged.jsonl"), "a", buffering=1) if rank == 0 else None
    running = {"family": None, "since": time.time()}
    _start_watchdog(running, family_seconds, mine)
    for family in model_types:
        running.update(family=family, since=time.time())
        mine.write(json.dumps({"start": family}) + "\n")
        result = run_family(family, name, *lengths)
        mine.write(json.dumps({"family": family, **_plain(result)}) + "\n")
        if "TimeoutError" in result["detail"] and result["outcome"] == "crash":
            raise RuntimeError(f"{family}: {result['detail']} (the process group is unusable after it)")
        per_rank = [None] * world
        dist.all_gather_object(per_rank, result)  # also where the ranks wait for each other
        running.update(family=None)
        if merged is not None:
            outcome = merge(family, per_rank)
            merged.write(json.dumps(outcome.__dict__) + "\n")
    return len(model_types)


def _plain(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("tokens", "logits")}


def _start_watchdog(running: dict, seconds: float, log) -> None:
    """A thread that ends this process (exit 124) once one family has run for `seconds`."""

    def watch():
        while True:
            time.sleep(1.0)
            family = running["family"]
            if family is not None and time.time() - running["since"] > seconds:
                log.write(json.dumps({"timeout": family, "seconds": seconds}) + "\n")
                log.flush()
                os._exit(124)

    threading.Thread(target=watch, daemon=True).start()


def run_zoo(
    model_types=None,
    nproc: int = 2,
    family_seconds: float = FAMILY_SECONDS,
    log=print,
    keep: str | None = None,
    lengths: tuple[int, int] = (PROMPT, NEW),
) -> dict[str, Outcome]:
    """{family: Outcome} of every family (or model_types), in order, each run in a local world of `nproc`
    ranks; a world that ends early (a hang, a dead rank, an unusable group) marks the family it was
    running a crash and a new world runs the rest. lengths: (prompt tokens, new tokens). keep: a folder
    for the ranks' logs (tracebacks included), else a temporary one."""
    from ..launch import spawn_world

    todo = list(model_types or families())
    rows: dict[str, Outcome] = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = keep or scratch
        os.makedirs(folder, exist_ok=True)
        while todo:
            start = time.time()
            env = {"BURST_AGREEMENT_TIMEOUT": str(AGREEMENT_SECONDS)}
            try:
                spawn_world(
                    zoo_world,
                    todo,
                    folder,
                    family_seconds,
                    tuple(lengths),
                    nproc=nproc,
                    threads=1,
                    timeout=family_seconds * len(todo) + 300,
                    env=env,
                )
                error = None
            except Exception as err:  # noqa: BLE001 - the world ended early: the family in flight is a crash
                error = err
            done = _read(os.path.join(folder, "merged.jsonl"))
            new = [f for f in todo if f in done]
            for family in new:
                rows[family] = Outcome(**done[family])
            todo = [f for f in todo if f not in done]
            log(
                f"world of {nproc}: {len(new)} families in {time.time() - start:.0f} s"
                + (f"; {error}" if error else "")
            )
            if not todo:
                break
            if error is None:
                raise RuntimeError(f"the world ended without a result for {todo[0]}")
            family = todo.pop(0)
            ranks = [_read_rank(os.path.join(folder, f"rank{r}.jsonl"), family) for r in range(nproc)]
            if not new and not any(ranks):  # the world failed before any family: not a family's doing
                raise RuntimeError(f"the world failed before running {family}: {error}") from error
            rows[family] = Outcome(family, "crash", _ended(error, ranks))
            log(f"{family}: crash: {rows[family].detail}")
    return {family: rows[family] for family in (model_types or families())}


def _read(path: str) -> dict[str, dict]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {row["family"]: row for row in map(json.loads, filter(str.strip, f))}


def _read_rank(path: str, family: str) -> str:
    """What one rank's log says of `family`: its result, that it timed out, or that it was running it."""
    said = []
    if os.path.exists(path):
        with open(path) as f:
            for row in map(json.loads, filter(str.strip, f)):
                if row.get("start") == family:
                    said = ["was running it"]
                elif row.get("family") == family:  # its own result, then waiting for the other ranks
                    said = [f"{row['outcome']}: {row['detail']}", "then waited for the other ranks"]
                elif row.get("timeout") == family:
                    said.append(f"ended by the watchdog after {row['seconds']:.0f} s")
    return ", ".join(said[1:] if said[:1] == ["was running it"] and len(said) > 1 else said)


def _ended(error: BaseException, ranks: list[str]) -> str:
    what = "; ".join(f"rank {r}: {said}" for r, said in enumerate(ranks) if said)
    return f"the world ended during it ({_first_line(error)}); {what}"


def table(rows: dict[str, Outcome]) -> str:
    """A Markdown table: family | outcome | detail."""
    lines = ["| family | outcome | detail |", "|---|---|---|"]
    for family, o in rows.items():
        detail = o.detail.replace("|", "/").replace("\n", " ")
        if o.outcome == "exact" and o.difference is not None:
            detail = f"logits within {o.difference:.1e} (relative)" + (f"; {detail}" if detail else "")
        lines.append(f"| {family} | {o.outcome} | {detail} |")
    return "\n".join(lines)
