"""``kvpush bench transfer --post-cost`` refuses bad arguments with a clear error before it
starts any process."""

from __future__ import annotations

import pytest

from kvpush_prod.bench.transfer import main


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--kinds", "contiguous,scattered"], "--kinds: unknown scattered"),
        (["--paths", "old,fast"], "--paths: unknown fast"),
        (["--layers", "32,x"], "comma lists of integers"),
        (["--tokens", "0"], "must be >= 1"),
        (["--iters", "0"], "must be >= 1"),
    ],
)
def test_bad_arguments_are_refused_with_what_is_wrong(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--post-cost", "--out", str(tmp_path), *argv])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err
