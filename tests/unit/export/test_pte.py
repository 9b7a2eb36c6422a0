"""ExecuTorch inference programs: parity of every zoo model with eager, refusals, inputs of any layout."""

import executorch  # noqa: F401  (a test dependency: missing, this file must fail, not skip)
import pytest
import torch

from export.pte import ExportError, export_pte, predict_pte
from fedge.model.spec import build
from fedge.model.zoo import MODELS, create

from helpers.export_models import SHAPE, weights

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("name", list(MODELS))
def test_inference_pte_matches_eager(name, mnist8, tmp_path):
    spec = create(name, SHAPE, 10)
    x, _ = mnist8
    report = export_pte(spec, weights(spec), tmp_path / f"{name}.pte", x)
    assert report.max_abs_diff <= 1e-4 and report.argmax_match
    assert report.delegated_calls >= 1
    assert (tmp_path / f"{name}.pte").stat().st_size == report.size_bytes
    print(f"{name}: max |diff| {report.max_abs_diff:.2e}, portable ops {report.non_delegated_ops}")


def test_export_pte_rejects_a_sample_of_the_wrong_shape(tmp_path):
    spec = create("cnn1", SHAPE, 10)
    with pytest.raises(ExportError, match=r"\(N, 1, 28, 28\)"):
        export_pte(spec, weights(spec), tmp_path / "m.pte", torch.zeros(2, 3, 28, 28))
    assert not (tmp_path / "m.pte").exists()


def test_inference_export_handles_inputs_with_a_size_one_channel_of_stride_one(tmp_path):
    """The digits dataset's (N, 1, 8, 8) tensors have channel stride 1; ExecuTorch would read that as a permuted
    dim order (XNNPACK then fails with 0x10), so the sample is made dense before tracing."""
    spec = create("cnn1", (1, 8, 8), 10)
    x = torch.rand(4, 8, 8, generator=torch.Generator().manual_seed(0)).as_strided((4, 1, 8, 8), (64, 1, 8, 1))
    assert x.stride() == (64, 1, 8, 1)
    report = export_pte(spec, weights(spec), tmp_path / "m.pte", x)
    assert report.max_abs_diff <= 1e-4
    # predict_pte: 6 inputs through a batch-4 program (the second batch padded)
    model = build(spec).eval()
    model.load_state_dict(weights(spec))
    six = torch.cat([x, x[:2].flip(0)])
    torch.testing.assert_close(predict_pte(tmp_path / "m.pte", six), model(six).detach(), rtol=0, atol=1e-4)


def test_a_teacher_programs_check_batch_spans_an_array_sorted_by_class():
    from export.pte import spread

    labels = torch.arange(10).repeat_interleave(50)  # 500 rows sorted by class: the first 16 are all of class 0
    assert set(torch.bincount(spread(labels, 16), minlength=10).tolist()) == {1, 2}  # 1.6 per class
    assert spread(labels, 16)[[0, -1]].tolist() == [0, 9] and torch.equal(spread(labels[:5], 16), labels[:5])
