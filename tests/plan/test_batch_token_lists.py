"""RolloutBatch.from_lists takes integer token ids only: anything else is refused naming the row,
never cast (1.7 would become token 1, True token 1)."""

import numpy as np
import pytest
import torch

from zorro_core import RolloutBatch


@pytest.mark.parametrize(
    "prompts, responses, says",
    [
        ([[1.7, 2.2]], [[3]], "prompt of row 0 holds float 1.7"),
        ([[1, 2]], [[3.9]], "response of row 0 holds float 3.9"),
        ([[1, 2], [3, 4.0]], [[5], [6]], "prompt of row 1 holds float 4.0"),
        ([[True, 2]], [[3]], "prompt of row 0 holds bool True"),
        ([[1, 2]], [[3, False]], "response of row 0 holds bool False"),
        ([[1, "2"]], [[3]], "prompt of row 0 holds str '2'"),
        ([[1, [2]]], [[3]], "prompt of row 0 holds list [2]"),
        ([[1, 2**64]], [[3]], "prompt of row 0 holds token id 18446744073709551616"),
        ([[1, None]], [[3]], "prompt of row 0 holds NoneType None"),
        ([torch.tensor([1.5, 2.0])], [[3]], "prompt of row 0 is a torch.float32 tensor"),
        ([np.array([1.0, 2.0])], [[3]], "prompt of row 0 is a float64 array"),
        ([torch.tensor([[1, 2]])], [[3]], "prompt of row 0 must be 1-D"),
        ([5], [[3]], "prompt of row 0 must be a sequence of token ids, got int"),
        (["12"], [[3]], "prompt of row 0 must be a sequence of token ids, got str"),
    ],
)
def test_non_integer_ids_are_refused(prompts, responses, says):
    with pytest.raises(ValueError, match="^" + _escape(says)):
        RolloutBatch.from_lists(prompts, responses)


def _escape(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize(
    "row",
    [[1, 2, 3], (1, 2, 3), np.array([1, 2, 3]), torch.tensor([1, 2, 3]), [np.int64(1), np.int32(2), 3], range(1, 4)],
)
def test_integer_ids_of_any_integer_type_are_taken(row):
    batch = RolloutBatch.from_lists([row], [[4, 5]])
    assert batch.prompts.dtype == torch.long
    assert batch.to_lists() == ([[1, 2, 3]], [[4, 5]])


def test_a_bool_pad_token_id_is_refused():
    with pytest.raises(ValueError, match="pad_token_id must be an int"):
        RolloutBatch.from_lists([[1]], [[2]], pad_token_id=True)
