"""RolloutBatch: the trainer's layout (verl's): left-padded prompts, right-padded responses.

A batch is validated once, when it is built, and is immutable: its fields cannot be reassigned
(a frozen dataclass), and a tensor changed in place since (`batch.prompts[0, 0] = -1`) is seen by
its version counter, which every in-place write bumps: `check_unchanged` (run by the actor at
every call) validates such a batch again. Reading four counters costs microseconds.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

META_BATCH = "the batch is on the meta device: its tensors hold no token ids (build it on a real device)"


def _versions(tensors: Sequence[torch.Tensor]) -> Optional[tuple[int, ...]]:
    """The in-place write counters of `tensors`; None where one has none (an inference-mode tensor)."""
    try:
        return tuple(t._version for t in tensors)
    except (RuntimeError, AttributeError):
        return None


@dataclass(frozen=True)
class RolloutBatch:
    """One batch of sampled sequences, as RL trainers hold it."""

    prompts: torch.Tensor
    """[B, P] token ids, left-padded."""
    prompt_mask: torch.Tensor
    """[B, P] 1 for a real prompt token, 0 for padding."""
    responses: torch.Tensor
    """[B, R] token ids, right-padded."""
    response_mask: torch.Tensor
    """[B, R] 1 for a real response token, 0 for padding."""
    _validated_at: Optional[tuple[int, ...]] = field(default=None, init=False, repr=False, compare=False)
    """The tensors' version counters when the batch was last validated (None: unknown)."""

    def __post_init__(self) -> None:
        self.validate()  # the one structural check; a moved copy or a sub-batch is not checked again

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.prompts, self.prompt_mask, self.responses, self.response_mask

    def _stamp(self) -> None:
        object.__setattr__(self, "_validated_at", _versions(self._tensors()))

    def check_unchanged(self) -> None:
        """Validate the batch again when a tensor was written in place since it was validated (or
        when that cannot be told: a tensor made under torch.inference_mode has no counter)."""
        now = _versions(self._tensors())
        if now is None or now != self._validated_at:
            self.validate()

    @classmethod
    def of_validated(
        cls, prompts: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor
    ) -> "RolloutBatch":
        """A batch of tensors taken from a validated batch (moved, or some of its rows): not checked again."""
        batch = cls.__new__(cls)
        for name, t in zip(
            ("prompts", "prompt_mask", "responses", "response_mask"), (prompts, prompt_mask, responses, response_mask)
        ):
            object.__setattr__(batch, name, t)
        batch._stamp()
        return batch

    @property
    def batch_size(self) -> int:
        return self.prompts.shape[0]

    @property
    def device(self) -> torch.device:
        return self.prompts.device

    def to(self, device: str | torch.device) -> "RolloutBatch":
        if self.device.type == "meta":
            raise ValueError(META_BATCH)
        return RolloutBatch.of_validated(
            *(t.to(device) for t in (self.prompts, self.prompt_mask, self.responses, self.response_mask))
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first problem found in the batch (token ids against `vocab_size` if given)."""
        p, pm, r, rm = self.prompts, self.prompt_mask, self.responses, self.response_mask
        for name, t in (("prompts", p), ("prompt_mask", pm), ("responses", r), ("response_mask", rm)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 2:
                raise ValueError(f"{name} must be 2-D [batch, length], got shape {tuple(t.shape)}")
        if p.shape[0] == 0:
            raise ValueError("empty batch: prompts has 0 rows")
        if pm.shape != p.shape:
            raise ValueError(f"prompt_mask shape {tuple(pm.shape)} does not match prompts shape {tuple(p.shape)}")
        if rm.shape != r.shape:
            raise ValueError(f"response_mask shape {tuple(rm.shape)} does not match responses shape {tuple(r.shape)}")
        if r.shape[0] != p.shape[0]:
            raise ValueError(f"prompts has {p.shape[0]} rows but responses has {r.shape[0]}")
        if p.shape[1] == 0 or r.shape[1] == 0:
            raise ValueError(
                f"prompts and responses need at least one column, got {tuple(p.shape)} and {tuple(r.shape)}"
            )
        devices = {t.device for t in (p, pm, r, rm)}
        if len(devices) != 1:
            raise ValueError(f"batch tensors are on different devices: {sorted(map(str, devices))}")
        if p.device.type == "meta":
            raise ValueError(META_BATCH)
        for name, t in (("prompts", p), ("responses", r)):
            if t.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"{name} must hold integer token ids (int64/int32), got {t.dtype}")
        for name, m in (("prompt_mask", pm), ("response_mask", rm)):
            if m.dtype != torch.bool and not bool(((m == 0) | (m == 1)).all()):
                raise ValueError(f"{name} must hold only 0 and 1")
        pmb, rmb = pm.bool(), rm.bool()
        empty_p = (~pmb.any(1)).nonzero().flatten()
        if empty_p.numel():
            raise ValueError(f"prompt of row {int(empty_p[0])} is all padding (prompt_mask is 0 everywhere)")
        empty_r = (~rmb.any(1)).nonzero().flatten()
        if empty_r.numel():
            raise ValueError(f"response of row {int(empty_r[0])} is all padding (response_mask is 0 everywhere)")
        # Left padding: once a real token starts, the mask never drops back to 0.
        bad_p = (pmb[:, :-1] & ~pmb[:, 1:]).any(1).nonzero().flatten()
        if bad_p.numel():
            raise ValueError(
                f"prompt of row {int(bad_p[0])} is not left-padded (a padding position follows a real token); "
                "prompts must be left-padded, responses right-padded"
            )
        bad_r = (~rmb[:, :-1] & rmb[:, 1:]).any(1).nonzero().flatten()
        if bad_r.numel():
            raise ValueError(
                f"response of row {int(bad_r[0])} is not right-padded (a real token follows padding); "
                "responses must be right-padded"
            )
        for name, ids, m in (("prompts", p, pmb), ("responses", r, rmb)):
            real = ids[m]
            if real.numel() and int(real.min()) < 0:
                raise ValueError(f"{name} holds a negative token id ({int(real.min())}) at a real position")
        if vocab_size is not None:
            self.check_vocab(vocab_size)
        self._stamp()

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a real token id is >= `vocab_size` (the rest is checked at construction)."""
        for name, ids, m in (
            ("prompts", self.prompts, self.prompt_mask),
            ("responses", self.responses, self.response_mask),
        ):
            real = ids[m.bool()]
            if real.numel() and int(real.max()) >= vocab_size:
                raise ValueError(f"{name} holds token id {int(real.max())} >= the model's vocab size {vocab_size}")

    @classmethod
    def from_lists(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        pad_token_id: int = 0,
        device: str | torch.device = "cpu",
    ) -> "RolloutBatch":
        """Build a batch from unpadded token lists: prompts are left-padded, responses right-padded.

        Each row is a sequence of integer token ids (ints, numpy integers, an integer array or
        tensor); anything else (a float, a bool, a string) is refused naming the row, never cast."""
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, numbers.Integral):
            raise ValueError(f"pad_token_id must be an int, got {type(pad_token_id).__name__} {pad_token_id!r}")
        prompts = [_id_row(pl, "prompt", i) for i, pl in enumerate(prompts)]
        responses = [_id_row(rl, "response", i) for i, rl in enumerate(responses)]
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        if len(prompts) == 0:
            raise ValueError("empty batch: no prompts given")
        for i, (pl, rl) in enumerate(zip(prompts, responses)):
            if len(pl) == 0:
                raise ValueError(f"prompt of row {i} is empty")
            if len(rl) == 0:
                raise ValueError(f"response of row {i} is empty")
        b = len(prompts)
        pmax = max(len(x) for x in prompts)
        rmax = max(len(x) for x in responses)
        p = torch.full((b, pmax), pad_token_id, dtype=torch.long)
        pm = torch.zeros((b, pmax), dtype=torch.long)
        r = torch.full((b, rmax), pad_token_id, dtype=torch.long)
        rm = torch.zeros((b, rmax), dtype=torch.long)
        for i, (pl, rl) in enumerate(zip(prompts, responses)):
            p[i, pmax - len(pl) :] = pl
            pm[i, pmax - len(pl) :] = 1
            r[i, : len(rl)] = rl
            rm[i, : len(rl)] = 1
        return cls(p.to(device), pm.to(device), r.to(device), rm.to(device))

    def to_lists(self) -> tuple[list[list[int]], list[list[int]]]:
        """The real tokens of each row, padding removed."""
        ps = [row[m.bool()].tolist() for row, m in zip(self.prompts.cpu(), self.prompt_mask.cpu())]
        rs = [row[m.bool()].tolist() for row, m in zip(self.responses.cpu(), self.response_mask.cpu())]
        return ps, rs


def check_batch(batch: object, who: str = "the actor") -> None:
    """TypeError unless `batch` is a RolloutBatch; ValueError when one was changed in place into an
    invalid batch since it was validated (RolloutBatch.check_unchanged)."""
    if not isinstance(batch, RolloutBatch):
        raise TypeError(
            f"{who} takes a zorro_core.RolloutBatch (prompts, prompt_mask, responses, response_mask), got "
            f"{type(batch).__name__}; build one with RolloutBatch(...) or RolloutBatch.from_lists(prompts, responses)"
        )
    batch.check_unchanged()


_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _id_row(row: object, what: str, i: int) -> torch.Tensor:
    """One row of `from_lists` as an int64 tensor; a non-integer id is refused naming the row and value."""
    where = f"{what} of row {i}"
    if isinstance(row, (str, bytes)) or not hasattr(row, "__len__"):
        raise ValueError(f"{where} must be a sequence of token ids, got {type(row).__name__}")
    if isinstance(row, torch.Tensor) or hasattr(row, "__array__"):
        t = torch.as_tensor(row)
        if t.dim() != 1:
            raise ValueError(f"{where} must be 1-D, got shape {tuple(t.shape)}")
        if t.dtype not in _INT_DTYPES:
            kind = (
                f"a {t.dtype} tensor" if isinstance(row, torch.Tensor) else f"a {getattr(row, 'dtype', t.dtype)} array"
            )
            raise ValueError(f"{where} is {kind}: token ids must be integers")
        return t.to(torch.long)
    ids = list(row)  # type: ignore[call-overload]  # any sized iterable: a list, a tuple, a range
    if set(map(type, ids)) <= {int}:  # the common case, checked at C speed (bool is not int here)
        if ids and not (-(2**63) <= min(ids) and max(ids) < 2**63):
            big = min(ids) if min(ids) < -(2**63) else max(ids)
            raise ValueError(f"{where} holds token id {big}, beyond int64")
        return torch.tensor(ids, dtype=torch.long)
    for x in ids:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise ValueError(f"{where} holds {type(x).__name__} {x!r}: token ids must be integers")
        if not -(2**63) <= int(x) < 2**63:
            raise ValueError(f"{where} holds token id {int(x)}, beyond int64")
    return torch.tensor(ids, dtype=torch.long)


def create_dummy_batch(
    batch_size: int = 16,
    num_unique_prompts: int = 2,
    prompt_len: int = 8192,
    response_len: int = 512,
    vocab_size: int = 151936,
    device: str | torch.device = "cpu",
    seed: int = 0,
    vary_lengths: bool = False,
    pad_token_id: int = 0,
    shuffle: bool = True,
    shared_prefix_len: int = 0,
) -> RolloutBatch:
    """A random batch of `batch_size` rows sharing `num_unique_prompts` distinct prompts.

    Rows are spread over the prompts as evenly as possible and, with `shuffle`, duplicates are
    not adjacent. With `vary_lengths`, prompts take lengths in [prompt_len/2, prompt_len] and
    responses in [1, response_len], so both carry padding. With `shared_prefix_len=S`, every
    prompt starts with the same S tokens (a system prompt) and then differs: distinct prompts
    differ in their token S, so S is exactly the run they share (`sharing="prefix"` shares it).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 1 <= num_unique_prompts <= batch_size:
        raise ValueError(f"num_unique_prompts must be in [1, batch_size={batch_size}], got {num_unique_prompts}")
    if prompt_len < 1 or response_len < 1:
        raise ValueError(f"prompt_len and response_len must be >= 1, got {prompt_len} and {response_len}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    shortest = max(1, prompt_len // 2) if vary_lengths else prompt_len
    if not 0 <= shared_prefix_len < shortest:
        raise ValueError(
            f"shared_prefix_len must be in [0, {shortest}) (shorter than every prompt), got {shared_prefix_len}"
        )
    if shared_prefix_len and num_unique_prompts > vocab_size - 1:
        raise ValueError(
            f"{num_unique_prompts} prompts cannot differ right after a shared prefix with {vocab_size - 1} token ids"
        )
    g = torch.Generator().manual_seed(seed)
    if vary_lengths:
        plens = torch.randint(max(1, prompt_len // 2), prompt_len + 1, (num_unique_prompts,), generator=g)
        rlens = torch.randint(1, response_len + 1, (batch_size,), generator=g)
    else:
        plens = torch.full((num_unique_prompts,), prompt_len)
        rlens = torch.full((batch_size,), response_len)
    # Distinct prompts: resample in the (unlikely) event two random prompts collide.
    uniq: list[list[int]] = []
    if shared_prefix_len:
        head = torch.randint(1, vocab_size, (shared_prefix_len,), generator=g).tolist()
        first = (
            torch.randperm(vocab_size - 1, generator=g)[:num_unique_prompts] + 1
        ).tolist()  # distinct after the head
        for i in range(num_unique_prompts):
            tail = torch.randint(1, vocab_size, (int(plens[i]) - shared_prefix_len - 1,), generator=g).tolist()
            uniq.append(head + [first[i]] + tail)
    while len(uniq) < num_unique_prompts:
        n = int(plens[len(uniq)])
        cand = torch.randint(1, vocab_size, (n,), generator=g).tolist()
        if cand not in uniq:
            uniq.append(cand)
    owner = torch.arange(batch_size) % num_unique_prompts
    if shuffle:
        owner = owner[torch.randperm(batch_size, generator=g)]
    prompts = [uniq[int(o)] for o in owner]
    responses = [torch.randint(1, vocab_size, (int(n),), generator=g).tolist() for n in rlens]
    return RolloutBatch.from_lists(prompts, responses, pad_token_id=pad_token_id, device=device)
