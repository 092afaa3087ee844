"""Benchmark suites: TOML files of axes, expanded into cases.

(Over 450 lines because a suite file is one format: the Case/Measure fields and the reader that checks
every key against them; apart, each field's checks would live away from its definition.)

    name = "quick"                 # top level: name, description, device, seed
    [measure]                      # warmup, repeats, phases, memory, timeout_s, threads
    repeats = 5
    [actor]                        # the actor options of every case: ActorConfig's field names
    attn_implementation = "sdpa"
    use_split_attention = true
    [defaults]                     # a value for any workload axis (Case field)
    model = "small-qwen3"
    [[grid]]                       # each grid: axes as lists (or scalars); cases = product
    num_unique_prompts = [1, 2, 8]
    prompt_len = [128, 512]
    actor.logits_mode = ["compute", "memory"]   # an actor option as an axis: a dotted key

The cases are the union over grids of the product of each grid's axes, on top of the
defaults (no grid: the defaults are one case). An axis may give `prompt_dedup_ratio`
instead of `num_unique_prompts` (rows share prompts evenly: unique = round(B x (1 - ratio))).
Unknown keys are an error that suggests the closest valid one. The actor options' older flat
spellings in [defaults] and [[grid]] (`split_attention`, `logits_mode`, ...: DEPRECATED_KEYS) are
read with a DeprecationWarning naming the new key.
"""

from __future__ import annotations

import difflib
import fnmatch
import itertools
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from zorro_core.actor.config import ActorConfig
from zorro_core.attention.backends import BACKENDS
from zorro_core.plan.dtypes import DTYPES
from zorro_core.plan.trie import DEFAULT_MIN_SHARED_TOKENS

ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", "auto")
BASELINES = ("packed", "padded", "prompt")
PHASES = ("forward", "forward_backward")
MAX_CASES = 10_000
"""The most cases a suite may expand to (counted before any is built): at a few seconds a case, a
sweep of more runs for days, and a mistyped axis must not make `--list` hang while memory grows."""
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")

CASE_ACTOR = ActorConfig(attn_implementation="sdpa")
"""A case's actor options where its suite sets none: ActorConfig's defaults with sdpa attention (a
case names its attention; ActorConfig's None, "the model's own", would time whatever the checkpoint says)."""
NOT_BENCHED = ("logits_chunk_size", "router_aux_weighting", "max_seq_len")
"""Actor options a case keeps at ActorConfig's default: the case id and the results file have no
place for them, so two cases differing only there would be one case to the sweep."""
DEPRECATED_KEYS = {
    "split_attention": "use_split_attention",
    "attn_implementation": "attn_implementation",
    "logits_mode": "logits_mode",
    "logits_memory_budget_mib": "logits_memory_budget_mib",
    "sharing": "sharing",
    "min_shared_tokens": "min_shared_tokens",
    "varlen_backend": "varlen_backend",
}
"""Flat suite and --filter keys of the actor options, before they moved under `actor.`: old key ->
ActorConfig field. Still read, with a DeprecationWarning naming `actor.<field>`, until 2027-06-01 (the one
deprecation path of the suite format)."""


@dataclass(frozen=True)
class Case:
    """One benchmark case: a model, a way to run it, and a workload."""

    model: str = "small-qwen3"
    """Preset name, local checkpoint, or a name in the local HF cache."""
    actor: ActorConfig = CASE_ACTOR
    """The dedup arm's actor options (attn_implementation, use_split_attention, logits_mode, sharing, ...);
    the baseline arm runs the same attention and logits options without dedup. attn_implementation:
    eager, sdpa, flash_attention_2/3, flex_attention (mask mode) or auto (zorro_core.stack.auto picks,
    for both arms)."""
    dtype: str = "float32"
    """Model dtype."""
    device: str = "cpu"
    """cpu or cuda."""
    batch_size: int = 8
    """Rows of the batch (B)."""
    num_unique_prompts: Optional[int] = None
    """Distinct prompts among the rows (None: from prompt_dedup_ratio)."""
    prompt_dedup_ratio: Optional[float] = None
    """Alternative to num_unique_prompts: 1 - unique prompt tokens / all prompt tokens."""
    prompt_len: int = 256
    """Prompt tokens (the maximum when padding is on)."""
    response_len: int = 32
    """Response tokens (the maximum when padding is on)."""
    padding: bool = False
    """Vary lengths (prompts in [P/2, P], responses in [1, R]) so rows carry padding."""
    baseline: str = "packed"
    """packed: BaselineActor without padding, same backend (fair); padded: the plain HF forward;
    prompt: the DeduplicatedActor with sharing="prompt" (to measure what sharing="prefix" adds)."""
    shared_prefix_len: int = 0
    """Every prompt starts with the same this many tokens (a system prompt), then differs."""
    liger: bool = False
    """Apply Liger kernels (zorro_core.stack.liger.apply_liger) before timing; GPU only, else status=skipped."""
    checkpointing: bool = False
    """Gradient checkpointing on every decoder layer (non-reentrant, transformers' API), model in training mode (both arms)."""
    seed: int = 0
    """Seed of the weights and the batch."""
    nproc: int = 1
    """Data-parallel ranks (> 1: the batch is the global one, the arms are no-regroup vs regroup; zorro_harness.bench.distributed)."""

    def actor_config(self, attn_implementation: Optional[str] = None, sharing: Optional[str] = None) -> ActorConfig:
        """The dedup arm's actor options as it runs them; `attn_implementation`: the resolved choice
        when the case says "auto"; `sharing` overrides the case's (the "prompt" baseline arm, the
        nproc > 1 arms). Mask mode has no varlen call, so no varlen backend."""
        a = self.actor
        return a.replace(
            attn_implementation=attn_implementation or a.attn_implementation,
            varlen_backend=a.varlen_backend if a.use_split_attention else None,
            sharing=sharing or a.sharing,
        )

    def __post_init__(self) -> None:
        if not isinstance(self.actor, ActorConfig):
            raise ValueError(f"actor must be an ActorConfig, got {type(self.actor).__name__}")
        a = self.actor
        # ActorConfig checked its own options when built; these are what a case adds to them.
        _check_choice("actor.attn_implementation", a.attn_implementation, ATTN_IMPLEMENTATIONS)
        if not isinstance(a.use_split_attention, bool):
            raise ValueError(f"actor.use_split_attention must be true or false, got {a.use_split_attention!r}")
        if a.varlen_backend is not None:
            _check_choice("actor.varlen_backend", a.varlen_backend, BACKENDS)
        for name in NOT_BENCHED:
            if getattr(a, name) != getattr(CASE_ACTOR, name):
                raise ValueError(
                    f"actor.{name} is not a benchmark option (the case id and the results file have no place "
                    f"for it): leave it at its default, {getattr(CASE_ACTOR, name)!r}"
                )
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("baseline", self.baseline, BASELINES)
        # The counts first: a prompt_len of 0 is what is wrong, not the shared prefix it bounds.
        for name in ("batch_size", "prompt_len", "response_len", "nproc"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if (
            not isinstance(self.shared_prefix_len, int)
            or isinstance(self.shared_prefix_len, bool)
            or not (0 <= self.shared_prefix_len < (max(1, self.prompt_len // 2) if self.padding else self.prompt_len))
        ):
            raise ValueError(
                f"shared_prefix_len must be an integer in [0, shortest prompt), got {self.shared_prefix_len!r}"
            )
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        for name in ("padding", "liger", "checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        for name in ("model", "device"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if self.num_unique_prompts is not None and not _is_int(self.num_unique_prompts):
            raise ValueError(f"num_unique_prompts must be an integer >= 1, got {self.num_unique_prompts!r}")
        if self.prompt_dedup_ratio is not None and not _is_number(self.prompt_dedup_ratio):
            raise ValueError(f"prompt_dedup_ratio must be a number in [0, 1), got {self.prompt_dedup_ratio!r}")
        if (self.num_unique_prompts is None) == (self.prompt_dedup_ratio is None):
            raise ValueError("give exactly one of num_unique_prompts and prompt_dedup_ratio")
        if self.num_unique_prompts is not None and not 1 <= self.num_unique_prompts <= self.batch_size:
            raise ValueError(
                f"num_unique_prompts must be in [1, batch_size={self.batch_size}], got {self.num_unique_prompts}"
            )
        if self.prompt_dedup_ratio is not None:
            if not 0 <= self.prompt_dedup_ratio < 1:
                raise ValueError(f"prompt_dedup_ratio must be in [0, 1), got {self.prompt_dedup_ratio}")
            # Normalize to a count, so one workload has one case id whichever way it was given.
            unique = max(1, round(self.batch_size * (1 - self.prompt_dedup_ratio)))
            object.__setattr__(self, "num_unique_prompts", unique)
            object.__setattr__(self, "prompt_dedup_ratio", None)

    @property
    def case_id(self) -> str:
        """Stable id of the case (the resume key, with the phase): a file format, kept as it was when
        the actor options were flat Case fields, so results files written then resume and compare."""
        a = self.actor
        parts = [
            self.model,
            str(a.attn_implementation),
            "split" if a.use_split_attention else "mask",
            a.logits_mode,
            self.dtype,
            self.device,
            f"b{self.batch_size}u{self.num_unique_prompts}p{self.prompt_len}r{self.response_len}",
        ]
        if self.padding:
            parts.append("pad")
        if self.baseline != "packed":
            parts.append(f"base-{self.baseline}")
        if a.varlen_backend:
            parts.append(a.varlen_backend)
        if self.liger:
            parts.append("liger")
        if self.checkpointing:
            parts.append("ckpt")
        if a.logits_memory_budget_mib is not None:
            parts.append(f"lmb{a.logits_memory_budget_mib:g}")
        if self.seed:
            parts.append(f"seed{self.seed}")
        if self.nproc > 1:
            parts.append(f"nproc{self.nproc}")
        if self.shared_prefix_len:
            parts.append(f"sys{self.shared_prefix_len}")
        if a.sharing != "prompt":  # the default run length is left out, as when it could be left unset
            fold = "" if a.min_shared_tokens == DEFAULT_MIN_SHARED_TOKENS else str(a.min_shared_tokens)
            parts.append(f"{a.sharing}{fold}")
        return ":".join(parts)

    @property
    def nominal_prompt_dedup_ratio(self) -> float:
        """Prompt dedup ratio with equal prompt lengths (the plan gives the exact one)."""
        return 1 - self.unique_prompts / self.batch_size

    @property
    def unique_prompts(self) -> int:
        """Distinct prompts (num_unique_prompts, normalised from prompt_dedup_ratio when that was given)."""
        if self.num_unique_prompts is None:  # unreachable: __post_init__ sets it
            raise ValueError("a Case has num_unique_prompts once built")
        return self.num_unique_prompts


@dataclass(frozen=True)
class Measure:
    """How each case is measured."""

    warmup: int = 1
    """Untimed runs of each arm per phase before the timed rounds (at least one is always run)."""
    repeats: int = 5
    """Timed rounds per phase."""
    phases: tuple[str, ...] = PHASES
    """forward (log-probs under no_grad) and/or forward_backward (log-probs, loss, backward)."""
    memory: bool = True
    """Measure peak memory (CPU: one extra fresh process per arm and phase)."""
    timeout_s: float = 600.0
    """Wall-clock limit of one case's process; past it the case is a status=timeout row."""
    threads: int = 0
    """torch intra-op threads in the case process (0: torch's default)."""

    def __post_init__(self) -> None:
        for name, least in (("warmup", 0), ("repeats", 1), ("threads", 0)):
            v = getattr(self, name)
            if not _is_int(v) or v < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {v!r}")
        cores = os.cpu_count() or 1
        if self.threads > cores:
            # More threads than cores only oversubscribes (and past OpenMP's limit fails in the case).
            raise ValueError(
                f"threads {self.threads} is more than the {cores} CPU core(s) here; use at most {cores} "
                "(0: torch's default)"
            )
        if not isinstance(self.memory, bool):
            raise ValueError(f"memory must be true or false, got {self.memory!r}")
        if not (_is_number(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}")
        if isinstance(self.phases, str):  # phases = "forward": one phase, not its letters
            object.__setattr__(self, "phases", (self.phases,))
        if not isinstance(self.phases, (list, tuple)):
            raise ValueError(f"phases must be a list of phases ({', '.join(PHASES)}), got {self.phases!r}")
        object.__setattr__(self, "phases", tuple(self.phases))
        for p in self.phases:
            _check_choice("phases", p, PHASES)
        if not self.phases:
            raise ValueError("phases must name at least one phase")


@dataclass
class Suite:
    """A named list of cases and how to measure them."""

    name: str
    cases: list[Case]
    measure: Measure = field(default_factory=Measure)
    description: str = ""
    device: str = "cpu"
    seed: int = 0
    source: Optional[str] = None
    """Path of the TOML file, if any."""

    def __post_init__(self) -> None:
        check_suite_name(self.name)

    def filtered(self, exprs: Iterable[str]) -> "Suite":
        """Only the cases matching every expression (see `case_matches`)."""
        exprs = list(exprs)
        return replace(self, cases=[c for c in self.cases if all(case_matches(c, e) for e in exprs)])

    def on_device(self, device: str) -> "Suite":
        return replace(self, device=device, cases=[replace(c, device=device) for c in self.cases])


def check_suite_name(name: Any) -> None:
    """ValueError unless `name` is a plain name: it picks the default results path
    (results/<name>.csv, .json, .lock), so it must not be a path or hold odd characters."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"suite name {name!r} is not a plain name: use 1 to 100 letters, digits, '_', '-' and '.', "
            "starting with a letter, a digit or '_' (no path separators, no '..'; the name picks "
            "results/<name>.csv, and --out writes anywhere else)"
        )


def case_matches(case: Case, expr: str) -> bool:
    """`key=value` compares a case field, or `actor.<field>` an actor option (as text; value may
    hold * and ?), anything else is a substring or glob of the case id."""
    if "=" in expr:
        key, value = (s.strip() for s in expr.split("=", 1))
        if key in DEPRECATED_KEYS:
            key = _deprecated(key, "--filter")
        if key not in _FILTER_KEYS:
            raise ValueError(f"unknown filter key {key!r}{_suggest(key, _FILTER_KEYS)}")
        actual = getattr(case.actor, key[len(_ACTOR) :]) if key.startswith(_ACTOR) else getattr(case, key)
        text = str(actual).lower() if isinstance(actual, bool) else str(actual)
        return fnmatch.fnmatchcase(text, value.lower() if isinstance(actual, bool) else value)
    if any(ch in expr for ch in "*?["):
        return fnmatch.fnmatchcase(case.case_id, expr)
    return expr in case.case_id


def _is_int(v: Any) -> bool:
    """An integer, not a bool (TOML's true is not 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    """A finite int or float, not a bool (nan would pass every comparison's negation)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _suggest(key: str, valid: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"


def _check_choice(name: str, value: Any, choices: Iterable[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} {value!r} is not one of {', '.join(choices)}")


def _check_keys(where: str, table: dict, valid: Iterable[str]) -> None:
    valid = list(valid)
    for key in table:
        if key not in valid:
            raise ValueError(f"unknown key {key!r} in {where}{_suggest(key, valid)}")


_ACTOR = "actor."
_TOP = ("name", "description", "device", "seed", "measure", "actor", "defaults", "grid")
_CASE_KEYS = tuple(f.name for f in fields(Case) if f.name != "actor")
_ACTOR_KEYS = tuple(f.name for f in fields(ActorConfig))
_FILTER_KEYS = (*_CASE_KEYS, *(_ACTOR + k for k in _ACTOR_KEYS))
_MEASURE = tuple(f.name for f in fields(Measure))


def _deprecated(key: str, where: str) -> str:
    """The new spelling of an old flat actor key, with a one-line DeprecationWarning."""
    new = _ACTOR + DEPRECATED_KEYS[key]
    warnings.warn(
        f"{where}: {key!r} is deprecated, write {new!r} instead (read until 2027-06-01)",
        DeprecationWarning,
        stacklevel=4,
    )
    return new


def _axes(where: str, table: dict[str, Any]) -> dict[str, Any]:
    """A [defaults] or [[grid]] table with its actor options as `actor.<field>` keys: the dotted
    `actor.x = ...` (TOML's nested table) and the deprecated flat `x = ...` alike."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key == "actor":
            if not isinstance(value, dict):
                raise ValueError(f"actor in {where} must be a table of actor options (actor.logits_mode = ...)")
            for k, v in value.items():
                if k not in _ACTOR_KEYS:
                    raise ValueError(f"unknown key {_ACTOR + k!r} in {where}{_suggest(_ACTOR + k, _axis_names())}")
                _put(out, _ACTOR + k, v, where)
        elif key in DEPRECATED_KEYS:
            _put(out, _deprecated(key, where), value, where)
        elif key in _CASE_KEYS:
            _put(out, key, value, where)
        else:
            raise ValueError(f"unknown key {key!r} in {where}{_suggest(key, _axis_names())}")
    return out


def _put(out: dict[str, Any], key: str, value: Any, where: str) -> None:
    if key in out:
        raise ValueError(f"{key} is given twice in {where} (once under its deprecated flat name)")
    out[key] = value


def _axis_names() -> list[str]:
    return [*_CASE_KEYS, *(_ACTOR + k for k in _ACTOR_KEYS)]


def _case(spec: dict[str, Any], actor: dict[str, Any]) -> Case:
    """The Case of one point of the product: `actor.<field>` keys over the suite's [actor] options."""
    options = {**actor, **{k[len(_ACTOR) :]: v for k, v in spec.items() if k.startswith(_ACTOR)}}
    rest = {k: v for k, v in spec.items() if not k.startswith(_ACTOR)}
    return Case(actor=CASE_ACTOR.replace(**options), **rest)


def expand(defaults: dict[str, Any], grids: list[dict[str, Any]], actor: Optional[dict[str, Any]] = None) -> list[Case]:
    """Cases of the product of each grid's axes over the defaults, in order, duplicates dropped.
    Keys are Case fields, and `actor.<field>` for an actor option (over `actor`, the options every
    case starts from). ValueError when the products add up to more than MAX_CASES (counted before
    any case is built)."""
    cases: list[Case] = []
    seen: set[str] = set()
    all_axes = [{k: (v if isinstance(v, list) else [v]) for k, v in grid.items()} for grid in grids or [{}]]
    for axes in all_axes:
        for k, v in axes.items():
            if not v:
                raise ValueError(f"axis {k!r} is an empty list")
    sizes = [math.prod(len(v) for v in axes.values()) for axes in all_axes]
    if sum(sizes) > MAX_CASES:
        biggest = max(range(len(sizes)), key=sizes.__getitem__)
        shape = " x ".join(f"{len(v)} {k}" for k, v in all_axes[biggest].items())
        raise ValueError(
            f"the suite expands to {sum(sizes):,} cases (grid #{biggest + 1}: {shape}), over the cap of "
            f"{MAX_CASES:,} cases a suite may have; split it into smaller suites or fewer values per axis"
        )
    for axes in all_axes:
        keys = list(axes)
        for combo in itertools.product(*(axes[k] for k in keys)):
            values = dict(zip(keys, combo))
            spec = {**defaults, **values}
            # A grid that gives one way of saying "how many prompts" overrides the other default.
            if "prompt_dedup_ratio" in values and "num_unique_prompts" not in values:
                spec.pop("num_unique_prompts", None)
            if "num_unique_prompts" in values and "prompt_dedup_ratio" not in values:
                spec.pop("prompt_dedup_ratio", None)
            case = _case(spec, actor or {})
            if case.case_id not in seen:
                seen.add(case.case_id)
                cases.append(case)
    return cases


def parse_suite(data: dict[str, Any], source: Optional[str] = None, name: Optional[str] = None) -> Suite:
    """A Suite from the parsed TOML table."""
    _check_keys("the suite", data, _TOP)
    for key, kind in (
        ("name", str),
        ("description", str),
        ("device", str),
        ("measure", dict),
        ("actor", dict),
        ("defaults", dict),
    ):
        if key in data and not isinstance(data[key], kind):
            raise ValueError(f"{key} must be a {'table' if kind is dict else 'string'}, got {data[key]!r}")
    if not isinstance(data.get("grid", []), (list, dict)) or any(
        not isinstance(g, dict) for g in (data["grid"] if isinstance(data.get("grid"), list) else [])
    ):
        raise ValueError("grid must be one [[grid]] table or several")
    measure_t = data.get("measure", {})
    actor = dict(data.get("actor", {}))
    grids = data.get("grid", [])
    if isinstance(grids, dict):
        grids = [grids]
    _check_keys("[measure]", measure_t, _MEASURE)
    _check_keys("[actor]", actor, _ACTOR_KEYS)
    defaults = _axes("[defaults]", data.get("defaults", {}))
    grids = [_axes(f"[[grid]] #{i + 1}", g) for i, g in enumerate(grids)]
    measure = Measure(**measure_t)
    if not {"actor", "defaults", "grid"} & set(data):
        raise ValueError("defines no case (no [actor], [defaults] or [[grid]]); see suites/ for examples")
    device = data.get("device", "cpu")
    seed = data.get("seed", 0)
    defaults.setdefault("device", device)
    defaults.setdefault("seed", seed)
    if "prompt_dedup_ratio" not in defaults:
        defaults.setdefault("num_unique_prompts", 1)
    if "name" in data:
        check_suite_name(data["name"])
    elif name is not None and not _NAME.fullmatch(name):
        raise ValueError(f'the file name gives the suite no plain name ({name!r}): set name = "..." in it')
    return Suite(
        name=data.get("name") or name or "suite",
        cases=expand(defaults, grids, actor),
        measure=measure,
        description=data.get("description", ""),
        device=device,
        seed=seed,
        source=source,
    )


def load_suite(path: str | Path) -> Suite:
    """Read and expand a suite file; errors name the file and the problem."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"suite file {str(path)!r} is a directory, not a TOML file")
    if path.exists() and not path.is_file():
        raise ValueError(f"suite file {str(path)!r} is not a regular file (a device or a pipe), not a TOML file")
    if not path.is_file():
        raise ValueError(f"suite file {str(path)!r} not found")
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}), not a TOML suite") from None
    if not text.strip():
        raise ValueError(f"{path} is empty: a suite defines its cases in [defaults] and [[grid]] (see suites/)")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from e
    try:
        return parse_suite(data, source=str(path), name=path.stem)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from e
