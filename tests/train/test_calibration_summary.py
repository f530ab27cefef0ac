"""The calibration sentence says plainly which side used more memory (seen wrong on the H200 run)."""

from notebookkit.train.calibration import CalibrationResult, CalibrationRun


def _result(nk_gib: float, peft_gib: float) -> CalibrationResult:
    nk = CalibrationRun("notebookkit", [3.0, 2.0, 1.0], nk_gib, 1226.0, 8.2, "GPU allocated")
    pe = CalibrationRun("plain PEFT", [3.0, 2.1, 1.1], peft_gib, 898.0, 11.0, "GPU allocated")
    return CalibrationResult(nk, pe, device="NVIDIA H200", steps=30, card_memory_gib=140.0)


def test_more_memory_is_called_more_and_explained():
    text = _result(1.869, 1.167).summary()
    assert "60% more memory" in text and "auto" in text
    assert "-60%" not in text


def test_less_memory_is_called_less():
    text = _result(0.59, 6.15).summary()
    assert "90% less memory" in text
    assert "1.37x the tokens/s" in text
