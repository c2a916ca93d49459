"""What happens when a user evaluator raises: its error is the checkpoint's evaluation
failure, in one line; ckptflow's own errors, and every error without an evaluator, pass."""

import pytest

from ckptflow.errors import CkptflowError, EvaluatorError, StoreUnavailableError
from ckptflow.lifecycle.evaluate import evaluator_errors

CKPT = "r@2"


def test_an_evaluator_error_names_the_evaluator_the_checkpoint_and_the_error():
    with pytest.raises(EvaluatorError) as raised:
        with evaluator_errors("team.eval:score", CKPT):
            raise ZeroDivisionError("division by zero")
    assert str(raised.value) == f"evaluator team.eval:score failed on {CKPT}: ZeroDivisionError: division by zero"
    assert isinstance(raised.value.__cause__, ZeroDivisionError)


def test_a_long_error_is_cut_to_one_bounded_line():
    with pytest.raises(EvaluatorError) as raised:
        with evaluator_errors("team.eval:score", CKPT):
            raise ValueError("x" * 5000)
    assert len(str(raised.value)) == 2000


@pytest.mark.parametrize("error", [CkptflowError("chunk 12ab… is corrupt"), StoreUnavailableError("SlowDown")])
def test_ckptflow_errors_pass_through_unchanged(error):
    with pytest.raises(type(error)) as raised:
        with evaluator_errors("team.eval:score", CKPT):
            raise error
    assert raised.value is error


def test_without_an_evaluator_every_error_passes_through():
    with pytest.raises(KeyError):
        with evaluator_errors(None, CKPT):
            raise KeyError("val_loss")
