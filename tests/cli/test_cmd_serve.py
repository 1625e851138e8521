"""`prima serve` flags: registered with the CLI, checked before the model loads."""

from __future__ import annotations

import pytest

from prima.cli.cmd_serve import _model_id
from prima.cli.main import build_parser, main


def test_serve_is_a_prima_command_with_its_defaults() -> None:
    args = build_parser().parse_args(["serve", "--port", "0"])
    assert args.command == "serve"
    assert args.host == "127.0.0.1"
    assert args.port == 0
    assert args.temp == 0.7


@pytest.mark.parametrize(
    ("flags", "words"),
    [(["--port", "70000"], "argument --port"), (["-n", "0"], "argument -n/--n-predict")],
)
def test_bad_flags_fail_before_loading(
    flags: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *flags])
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


def test_model_id_is_the_name_or_the_file_stem() -> None:
    assert _model_id("smollm2-135m") == "smollm2-135m"
    assert _model_id("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
