"""The zoo: every causal-LM family transformers ships, built tiny from its own config class, run on
burst's backend against the same model's eager attention in one process.

Each family ends in one of:
  exact    logits and loss match eager attention (max abs difference <= TOLERANCE), and one backward's
           every parameter gradient (gradient_error <= GRADIENT_TOLERANCE) where the loss runs
  refused  burst raised a clear error (ValueError / NotImplementedError raised inside burst), or
           transformers itself would not build the model with a custom attention implementation
  silent   ran and differs, with no error: the outcome burst must never have (a forward's says whether
           the family's own sdpa differs from its eager too: _control)
  crash    any other exception (a traceback from the model or transformers)
  skip     the family could not be built tiny, or its eager model does not run on token ids alone

    from burst.bench.hf_zoo import families, run_zoo
    rows = run_zoo(families())   # on every rank of the world alike: {family: {setting: Outcome}}

`tiny_config(model_type)` (burst/bench/hf_zoo_configs.py) shrinks a family's default config (its attention
features kept: GQA, sliding layers, sinks, softcap, q/k norms, MLA head dims, chunked attention, per-layer
head sizes): every size attribute the config and its sub-configs have is set small, and a per-layer
pattern (`layer_types`) keeps one layer of each kind. A family whose own loss needs more than token ids
(GIT, MusicGen) is compared on its logits alone ("exact: logits only").
tests/test_hf_zoo.py runs it at 1 and 2 ranks; benchmarks/hf_zoo.py writes the table. A tool for the
tests and the benchmarks of burst.integrations.transformers, not part of it.
"""

from __future__ import annotations

import copy
import os
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.membership import group_size
from .hf_steps import gradient_error, twin_on
from .hf_zoo_configs import OVERRIDES, RETRIES, SEQ_LEN, SIZES, VOCAB, causal_lm, draw, tiny_config  # noqa: F401

TOLERANCE = 2e-4
GRADIENT_TOLERANCE = 1e-4  # gradient_error's relative measure, as the flagship and rope tests hold it
MAX_PARAMETERS = 30_000_000


@dataclass
class Outcome:
    family: str
    outcome: str  # exact | refused | silent | crash | skip
    detail: str = ""  # the error's first line, the difference, or why skipped
    difference: float | None = None


def families() -> list[str]:
    """Every model_type of transformers' causal-LM auto mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class _Skip(Exception):
    """The family cannot be built tiny (it is listed as skipped, with the reason)."""


class _RefusedByBurst(Exception):
    """burst's own check refuses the family before it is built (bt.check_backend_compatible)."""


class _NotBuilt(Exception):
    """transformers itself raises when the family is built with a custom attention implementation."""


def build(model_type: str, attn_implementation: str, ids: torch.Tensor, positions: torch.Tensor):
    """(eager model's output on ids, the same weights on attn_implementation, the eager model) for
    the first of RETRIES whose tiny config builds and runs eagerly; raises the first retry's error
    otherwise (or, where no retry failed, that the model is not tiny)."""
    return build_with(model_type, attn_implementation, lambda eager: _forward(eager, ids, positions))


def build_with(model_type: str, attn_implementation: str, reference):
    """build's rules with `reference(eager model)` as what the eager model is run for (its forward, or
    its generate(): hf_zoo_generate.py): (that result, the same weights on attn_implementation, the
    eager model)."""
    first = None
    for keep_default in RETRIES:
        try:
            config = tiny_config(model_type, keep_default)
            with torch.device("meta"):  # counted before any memory is spent: a size SIZES missed stays huge
                parameters = sum(p.numel() for p in causal_lm(model_type, copy.deepcopy(config)).parameters())
            if parameters > MAX_PARAMETERS and first is not None:  # later retries keep more defaults: no smaller
                raise first
            if parameters > MAX_PARAMETERS:
                raise _Skip(f"not tiny: {parameters / 1e6:.0f}M parameters (sub-models SIZES does not reach)")
            torch.manual_seed(0)
            eager = causal_lm(model_type, copy.deepcopy(config), attn_implementation="eager").eval()
            draw(model_type, eager)
            twin = copy.deepcopy(eager)  # before the forward: a module may keep state from one
            expected = reference(eager)
        except _Skip:
            raise
        except Exception as err:  # noqa: BLE001 - the family's own limits; the next retry keeps more defaults
            first = first or err
            continue
        from ..integrations.transformers.backend.checks import check_buildable

        try:  # burst's own refusal, before transformers' bare KeyError
            check_buildable(attn_implementation, config)
        except ValueError as err:
            raise _RefusedByBurst(_first_line(err)) from err
        try:
            model = twin_on(model_type, twin, config, attn_implementation)
        except Exception as err:  # noqa: BLE001 - transformers' own refusal of a custom attention name
            raise _NotBuilt(_first_line(err)) from err
        return expected, model.eval(), eager
    raise first


def _forward(model, ids, positions):
    """The model's output on ids with them as labels too, its loss with its graph (the gradients'
    reference: _compare_gradients); its logits alone (loss None) where its own loss needs more than token
    ids (GIT's drops the image tokens it assumes, MusicGen's labels are per codebook)."""
    try:
        return model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    except Exception as err:  # noqa: BLE001 - the logits alone, or the error with labels
        try:
            with torch.no_grad():
                return model(input_ids=ids, position_ids=positions, use_cache=False)
        except Exception:  # noqa: BLE001
            raise err from None


def run_family(model_type: str, name: str, layout: str, group=None, built=None) -> tuple[Outcome, tuple | None]:
    """One family on the registered burst backend `name` (layout `layout`) over `group`, on every
    rank: (its Outcome, what `build` returned, to run again under another name, or None).
    built: that from an earlier call, with the model switched to `name`."""
    ids = torch.randint(3, VOCAB, (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ_LEN)[None]
    try:
        built = built if built is not None else build(model_type, name, ids, positions)
    except _Skip as err:
        return Outcome(model_type, "skip", str(err)), None
    except _RefusedByBurst as err:
        return Outcome(model_type, "refused", str(err)), None
    except _NotBuilt as err:
        return Outcome(model_type, "refused", f"by transformers, at from_config: {err}"), None
    except Exception as err:  # noqa: BLE001 - any failure to build or run eagerly is the family's, not burst's
        return Outcome(model_type, "skip", f"eager model does not run tiny on token ids: {_first_line(err)}"), None
    expected, model, eager = built
    outcome, loss = _compare(model_type, expected, model, ids, positions, layout, group)
    if outcome.outcome == "silent":
        outcome.detail += _control(model_type, eager, expected, ids, positions)
    if outcome.outcome == "exact" and loss is not None:  # one backward: every parameter's gradient
        outcome = _compare_gradients(outcome, eager, expected, model, loss, group)
    return outcome, built


def _compare(model_type, expected, model, ids, positions, layout, group) -> tuple[Outcome, torch.Tensor | None]:
    """The split model's logits and loss against eager's: (the Outcome, this rank's loss with its graph
    for the backward, where the family's loss runs on token ids: the forward is not run twice)."""
    from ..integrations import transformers as bt

    train = expected.loss is not None
    try:
        labels = {"labels": ids} if train else {}
        batch = bt.shard_batch(
            {"input_ids": ids, **labels, "position_ids": positions}, group=group, layout=layout, model=model
        )
        with torch.set_grad_enabled(train):
            got = model(**batch, use_cache=False)
        logits = _unshard(got.logits.detach(), group, layout)
        loss = bt.reduce_loss(got.loss.detach(), group) if got.loss is not None else None
    except Exception as err:  # noqa: BLE001 - classified: burst's own clear error, or a crash
        kind = "refused" if _raised_by_burst(err) else "crash"
        return Outcome(model_type, kind, _first_line(err)), None
    if train and got.loss is None:
        return Outcome(model_type, "crash", "the split model returned no loss for its labels"), None
    difference = (logits.double() - expected.logits.detach().double()).abs().max().item()
    if loss is not None and expected.loss is not None:
        difference = max(difference, abs(loss.item() - expected.loss.item()))
    if difference <= TOLERANCE:
        note = "" if train else "logits only (its loss needs more than token ids)"
        return Outcome(model_type, "exact", note, difference), got.loss if train else None
    return Outcome(model_type, "silent", f"max abs difference {difference:.2e}", difference), None


def _control(model_type: str, eager, expected, ids, positions) -> str:
    """A silent outcome's control: the family's own sdpa on eager's weights against its eager logits. Where
    they differ too, the family's two paths disagree in this transformers release (moshi's on 5.17)."""
    try:
        sdpa = twin_on(model_type, eager, eager.config, "sdpa", switch=False).eval()
        with torch.no_grad():
            logits = sdpa(input_ids=ids, position_ids=positions, use_cache=False).logits
    except Exception as err:  # noqa: BLE001 - a family without sdpa: no control
        return f"; no control (its sdpa: {_first_line(err)})"
    difference = (logits.double() - expected.logits.detach().double()).abs().max().item()
    if difference > TOLERANCE:
        return f"; its own sdpa differs from its eager too, by {difference:.2e} (transformers' paths disagree)"
    return f"; its own sdpa agrees with its eager ({difference:.1e}): burst's difference"


def _compare_gradients(outcome: Outcome, eager, expected, model, loss, group) -> Outcome:
    """The exact forward's outcome, or what one backward of its `loss` shows: every parameter's gradient
    (reduce_gradients) against eager's in this process (the backward of `expected`'s loss, once per
    family, kept for its other settings), within GRADIENT_TOLERANCE (gradient_error's relative measure)."""
    from ..integrations import transformers as bt

    try:
        model.zero_grad(set_to_none=True)
        if all(p.grad is None for p in eager.parameters()):
            expected.loss.backward()
        loss.backward()
        bt.reduce_gradients(model, group)
    except Exception as err:  # noqa: BLE001 - classified as the forward's errors are
        return Outcome(outcome.family, "refused" if _raised_by_burst(err) else "crash", "backward: " + _first_line(err))
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters()) if q.grad is not None]
    if any(p is None for p, _ in pairs):
        return Outcome(outcome.family, "silent", "backward: a parameter eager differentiates got no gradient")
    error = gradient_error(pairs)
    if error > GRADIENT_TOLERANCE:
        return Outcome(outcome.family, "silent", f"backward: gradients off by {error:.2e} (relative)", error)
    return outcome


def _unshard(local: torch.Tensor, group, layout: str) -> torch.Tensor:
    from .. import layout as layout_mod

    world = group_size(group)
    return local if world == 1 else layout_mod.unshard(local.contiguous(), group=group, layout=layout, dim=1)


def _raised_by_burst(err: BaseException) -> bool:
    """A ValueError / NotImplementedError / TimeoutError raised inside the burst package."""
    if not isinstance(err, (ValueError, NotImplementedError, TimeoutError)):
        return False
    frames = traceback.extract_tb(err.__traceback__)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(package + os.sep)


def _first_line(err: BaseException) -> str:
    """The error's type and the first line of its message (and the next, where that line only introduces it)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    message = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    text = f"{type(err).__name__}: {message}"
    return text if len(text) <= 160 else text[:157] + "..."


def run_zoo(
    model_types, group=None, strategy: str = "burst", layouts=("contiguous", "zigzag")
) -> dict[str, dict[str, Outcome]]:
    """Every family at 1 rank and, on a world of G > 1 ranks, at G ranks in each of `layouts`:
    {family: {setting: Outcome}}, the same on every rank. Call on every rank of the group alike (the
    1-rank setting runs on a group of one rank, each rank for every G-th family)."""
    from ..integrations import transformers as bt

    world = group_size(group)
    rank = dist.get_rank(group) if world > 1 else 0
    names = {"1 rank": bt.register(f"zoo_{strategy}_alone", strategy=strategy, group=_own_group(group, world))}
    for layout in layouts if world > 1 else ():
        names[f"{world} ranks {layout}"] = bt.register(
            f"zoo_{strategy}_{layout}", strategy=strategy, layout=layout, group=group
        )
    groups = {setting: bt.BACKENDS[name].group for setting, name in names.items()}
    # The 1-rank setting is the same work on every rank: each rank runs it for its share of the families.
    rows = {}
    for i, family in enumerate(model_types):
        mine = {setting: name for setting, name in names.items() if setting != "1 rank" or i % world == rank}
        rows[family] = _family_in_every_setting(family, mine, groups)
    mine_alone = {family: by["1 rank"] for family, by in rows.items() if "1 rank" in by}
    shares = [mine_alone] * world  # every rank's share: gathered where there are several
    if world > 1:
        dist.all_gather_object(shares, mine_alone, group=group)
    alone = {family: outcome for share in shares for family, outcome in share.items()}
    return {family: {"1 rank": alone[family], **rows[family]} for family in model_types}


def _own_group(group, world: int):
    """This rank's group of one rank (`group` itself when it has one rank). Every rank creates every
    one-rank group, in the same order, as new_group requires."""
    if world == 1:
        return group
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    return [dist.new_group([r]) for r in ranks][dist.get_rank(group)]


def _family_in_every_setting(model_type: str, names: dict, groups: dict) -> dict[str, Outcome]:
    """One build of the family, run under each registered name (switched with transformers'
    set_attn_implementation; a family that cannot switch is built again). A family that cannot be
    built has that outcome in every setting."""
    outcomes, built = {}, None
    for setting, name in names.items():
        layout = "contiguous" if setting == "1 rank" else setting.rsplit(" ", 1)[-1]
        if built is not None:
            built[1].set_attn_implementation(name)
            if built[1].config._attn_implementation != name:
                built = None
        outcomes[setting], built = run_family(model_type, name, layout, groups[setting], built)
        if built is None and (outcomes[setting].outcome == "skip" or "at from_config" in outcomes[setting].detail):
            return {s: outcomes[setting] for s in names}
    return outcomes


def table(rows: dict[str, dict[str, Outcome]]) -> str:
    """A Markdown table: family, then one column per setting (e.g. "1 rank", "2 ranks zigzag")."""
    settings = list(next(iter(rows.values())))
    head = "| family | " + " | ".join(settings) + " |"
    lines = [head, "|---" * (len(settings) + 1) + "|"]
    for family, by_setting in rows.items():
        cells = []
        for setting in settings:
            o = by_setting[setting]
            cells.append(o.outcome + (f": {o.detail.replace('|', '/')}" if o.detail else ""))
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def zoo_world(
    rank: int, world: int, model_types=None, layouts=("contiguous", "zigzag")
) -> dict[str, dict[str, Outcome]]:
    """run_zoo on every family (or `model_types`) in `layouts`, as one rank of a local world
    (burst.launch.spawn_world)."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()  # tiny configs trip many of the families' own warnings
    warnings.filterwarnings("ignore")
    return run_zoo(model_types or families(), layouts=layouts)
