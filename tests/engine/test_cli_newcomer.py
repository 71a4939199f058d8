"""The engine's command line as a first run from the README meets it: a checkpoint path that names
no file or no checkpoint, the help of every option, the tiny checkpoint's prompt format and its
END token, combinations refused before anything loads, and video input (``--multimodal --frames N``)
with the committed vision tower or random weights (impl/model/cli.py)."""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from impl.model import cli

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / cli.TINY_CHECKPOINT
SMALL = ["--max-batch-size", "2", "--max-num-tokens", "64", "--max-seq-len", "256"]


def _run(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter, as a user runs it (one torch thread: two CI cores)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "impl.model.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _tokens(out: str, rid: str = "req0") -> list[int]:
    line = next(ln for ln in out.splitlines() if ln.startswith(f"{rid}: ["))
    return ast.literal_eval(line[len(rid) + 2:line.index("]") + 1])


def _line(out: str, rid: str = "req0") -> str:
    return next(ln for ln in out.splitlines() if ln.startswith(f"{rid}: "))


# ------------------------------------------------------------------ checkpoint files

def test_a_missing_checkpoint_is_one_line_naming_the_path_and_the_committed_one():
    r = _run("generate", "--checkpoint", "model.safetensors", "--prompt", "hi")
    both = r.stdout + r.stderr
    assert r.returncode == 2, both
    assert "Traceback" not in both
    lines = [ln for ln in both.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("--checkpoint model.safetensors: no such file")
    # What to do: the committed checkpoint's path, how it is trained, the run that needs none.
    assert cli.TINY_CHECKPOINT in lines[0] and "docs/training.md" in lines[0]
    assert "impl.train.train_tiny" in lines[0] and "--random-weights" in lines[0]


def test_a_garbage_checkpoint_file_is_named_without_a_traceback(tmp_path):
    bad = tmp_path / "garbage.safetensors"
    bad.write_bytes(b"\x00\x01 this is not a safetensors file" * 10)
    r = _run("generate", "--checkpoint", str(bad), "--prompt", "hi")
    both = r.stdout + r.stderr
    assert r.returncode == 2, both
    assert "Traceback" not in both
    assert f"checkpoint {bad}: not a readable safetensors file" in both
    assert both.splitlines()[-1] == ("--checkpoint takes a Flash-Next checkpoint (format: "
                                     f"docs/checkpoint.md), such as {cli.TINY_CHECKPOINT}")


def _safetensors_without_metadata(path: Path) -> str:
    from safetensors.torch import save_file
    save_file({"embed": torch.zeros(2, 2)}, str(path))
    return "no 'format' key in the safetensors metadata"


def _truncated_tiny(path: Path) -> str:
    path.write_bytes(TINY.read_bytes()[:100_000] if TINY.is_file() else b"\x10" * 64)
    return "not a readable safetensors file"


def _directory(path: Path) -> str:
    path.mkdir()
    return "is a directory; --checkpoint takes a checkpoint file"


@pytest.mark.parametrize("make", [_safetensors_without_metadata, _truncated_tiny, _directory],
                         ids=["no-metadata", "truncated", "directory"])
def test_an_invalid_checkpoint_names_the_file_and_the_problem(tmp_path, capsys, make):
    path = tmp_path / "model.safetensors"
    problem = make(path)
    assert cli.main(["generate", "--checkpoint", str(path), "--prompt", "hi"]) == 2
    out = capsys.readouterr().out
    assert str(path) in out and problem in out, out
    assert "docs/checkpoint.md" in out and cli.TINY_CHECKPOINT in out


# ------------------------------------------------------------------ help

def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _option_entries(help_text: str) -> dict[str, str]:
    """Option -> its whole help entry (the option line and its continuation lines)."""
    section = help_text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    entries: dict[str, str] = {}
    current = None
    for line in section.splitlines():
        m = re.match(r"  (-[-\w]+)", line)
        if m:
            current = m.group(1)
            entries[current] = line.strip()
        else:
            entries[current] += " " + line.strip()
    return entries


def test_top_level_help_says_what_the_tool_does():
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    assert "The Flash-Next engine from the command line." in r.stdout
    assert "explain" in r.stdout and "generate" in r.stdout
    assert cli.TINY_CHECKPOINT in r.stdout


@pytest.mark.parametrize("command", ["explain", "generate"])
def test_every_option_has_help_and_shows_its_default(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    entries = _option_entries(text)
    sub = _subparsers(cli._parser())[command]
    closed = {"--preset", "--device", "--model-dtype", "--kv-dtype", "--state-dtype", "--moe-backend",
              "--gdn-commit"}
    for action in sub._actions:
        if not action.option_strings or action.option_strings[0] == "-h":
            continue
        name = action.option_strings[0]
        assert action.help, f"{command} {name} has no help"
        entry = entries[name]
        assert "default" in entry, f"{command} {name} does not show its default: {entry!r}"
        if name in closed:
            assert action.choices, f"{command} {name} takes a closed set without choices"
            assert "{" in entry
    if command == "generate":   # the prompt format of the tiny checkpoint, with an example
        assert "prompt format of the tiny checkpoint" in text
        assert f"--checkpoint {cli.TINY_CHECKPOINT}" in text


# ------------------------------------------------------------------ stop at END

def _random_checkpoint(tmp_path: Path) -> Path:
    """A tiny checkpoint of seeded random weights (the tasks' byte vocabulary)."""
    from impl.model.checkpoint import save_checkpoint
    from spec.config import ModelConfig
    from spec.model import init_weights

    cfg = ModelConfig.tiny()
    path = tmp_path / "plain.safetensors"
    save_checkpoint(path, init_weights(cfg, seed=5, dtype=torch.bfloat16), cfg)
    return path


def test_a_checkpoint_stops_at_its_end_token_by_default(tmp_path, capsys):
    """END is planted: a copy of a random checkpoint whose LM head swaps the rows of END and of a
    token the original emits (first at position i, after no END) emits END there, and stops
    without --stop-token."""
    from impl.model.checkpoint import load_checkpoint, save_checkpoint
    from impl.tasks.tokenizer import END as end

    plain, planted = _random_checkpoint(tmp_path), tmp_path / "planted.safetensors"
    args = ["generate", "--prompt", "abc", "--max-new-tokens", "8", *SMALL]
    assert cli.main(args + ["--checkpoint", str(plain), "--no-stop-token"]) == 0
    before = _tokens(capsys.readouterr().out)
    assert len(before) == 8
    i = next(i for i in range(1, 8) if before[i] not in before[:i] and end not in before[:i + 1])
    ck = load_checkpoint(plain)
    w = ck.weights
    head = w.lm_head.clone()
    head[[end, before[i]]] = w.lm_head[[before[i], end]]
    w.lm_head.copy_(head)
    save_checkpoint(planted, w, ck.cfg)
    assert cli.main(args + ["--checkpoint", str(planted)]) == 0   # no --stop-token given
    out = capsys.readouterr().out
    assert _tokens(out) == before[:i] + [end]
    line = _line(out)
    assert "ended at END (3)" in line
    assert line.endswith("  " + ascii(bytes(before[:i]).decode("latin-1")))   # END left out
    assert "\\x03" not in line
    assert f"{i + 1} tokens in" in out


def test_stop_token_overrides_the_default_and_is_left_out_of_the_text(capsys):
    args = ["generate", "--random-weights", "--prompt", "hello", "--max-new-tokens", "8", *SMALL]
    assert cli.main(args) == 0
    full = _tokens(capsys.readouterr().out)
    i = next(i for i in range(1, len(full)) if full[i] not in full[:i])
    assert cli.main(args + ["--stop-token", str(full[i])]) == 0   # a planted stop token
    out = capsys.readouterr().out
    assert _tokens(out) == full[:i + 1]
    line = _line(out)
    assert f"ended at token {full[i]}" in line
    assert line.endswith("  " + ascii(bytes(full[:i]).decode("latin-1")))


@pytest.mark.skipif(not TINY.is_file() or TINY.stat().st_size < 1_000_000,
                    reason=f"{cli.TINY_CHECKPOINT} is not in this checkout")
def test_the_committed_checkpoint_answers_in_the_documented_format(capsys):
    """The README's MQAR example: BOS is prepended, the answer ends at END, the text is the value."""
    argv = ["generate", "--checkpoint", str(TINY), "--prompt", "AB=12 QX=08 MD=77 KE=40\n?QX=",
            "--max-new-tokens", "8", *SMALL]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert _tokens(out) == [ord("0"), ord("8"), 3]
    assert _line(out).endswith("ended at END (3)  '08'")


# ------------------------------------------------------------------ refused up front

@pytest.mark.parametrize("extra, rule", [(["--state-dtype", "fp16"], "state_dtype_supported"),
                                         (["--cuda-graphs"], "cuda_graphs_capture_on_cuda")])
def test_a_refusal_rule_is_named_before_the_checkpoint_loads(tmp_path, capsys, extra, rule):
    missing = tmp_path / "absent.safetensors"
    assert cli.main(["generate", "--checkpoint", str(missing), "--prompt", "a", *extra]) == 2
    out = capsys.readouterr().out
    assert rule in out and "no such file" not in out, out


@pytest.mark.parametrize("extra, message", [
    (["--index-share"], "--index-share is a setting of MTP speculation: it needs --draft-length"),
    (["--dynamic-draft-length"], "--dynamic-draft-length is a setting of MTP speculation"),
    (["--stop-token", "999"], "--stop-token 999: not a token id of this model (0..255)"),
])
def test_an_invalid_combination_is_refused_with_its_reason(extra, message, capsys):
    assert cli.main(["generate", "--random-weights", "--prompt", "a", *SMALL, *extra]) == 2
    out = capsys.readouterr().out
    assert message in out and "req0" not in out, out


def test_a_checkpoint_of_another_preset_is_refused(tmp_path, capsys):
    plain = _random_checkpoint(tmp_path)
    assert cli.main(["generate", "--checkpoint", str(plain), "--preset", "target",
                     "--prompt", "a"]) == 2
    assert "--preset target: checkpoint" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["--random-prompts", "-1"], ["--max-new-tokens", "0"],
                                   ["--stop-token", "3", "--no-stop-token"], ["--frames", "0"]])
def test_an_option_out_of_range_is_an_argparse_error(extra, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--random-weights", "--prompt", "a", *extra])
    assert e.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_a_prompt_the_tiny_tokenizer_cannot_read_is_refused(tmp_path, capsys):
    plain = _random_checkpoint(tmp_path)
    assert cli.main(["generate", "--checkpoint", str(plain), "--prompt", "caf\u00e9", *SMALL]) == 2
    out = capsys.readouterr().out
    assert "impl/tasks/tokenizer.py" in out and "'\u00e9'" in out


# ------------------------------------------------------------------ video input

VISION = ROOT / "checkpoints" / "flashnext-tiny-vision.safetensors"


@pytest.mark.skipif(not TINY.is_file() or not VISION.is_file() or TINY.stat().st_size < 1_000_000,
                    reason=f"{cli.TINY_CHECKPOINT} or its vision tower is not in this checkout")
def test_the_committed_checkpoint_names_the_frame_with_the_square(capsys):
    """The frame task's prompt (the run after BOS, then \\n?FR=) with the checkpoint's own tower,
    found beside it: each answer is the frame the line says holds the square."""
    argv = ["generate", "--checkpoint", str(TINY), "--multimodal", "--frames", "4", "--seed", "1",
            "--prompt", "\n?FR=", "--prompt", "\n?FR=", "--max-new-tokens", "4", *SMALL]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for rid in ("req0", "req1"):
        line = _line(out, rid)
        square = line.rsplit("the bright square in frame ", 1)[1].rstrip(")")
        assert f"ended at END (3)  '{square}'  (4 frames," in line, line
    assert "vision_tower=" in out


def test_random_weights_take_frames_and_random_prompts_skip_the_placeholder(capsys):
    """Random prompts of a multimodal engine leave out the placeholder id (else admission refuses
    them: 256 ids of 256 hold it about 2 times in 3); the frames run through the tower."""
    argv = ["generate", "--random-weights", "--multimodal", "--random-prompts", "4",
            "--prompt-len", "256", "--max-new-tokens", "2", "--max-batch-size", "4",
            "--max-num-tokens", "512", "--max-seq-len", "512"]
    assert cli.main(argv) == 0
    assert "REJECTED" not in capsys.readouterr().out
    assert cli.main(argv + ["--frames", "2", "--prompt", "hi"]) == 0
    out = capsys.readouterr().out
    assert "REJECTED" not in out and "vision_tower=" in out
    assert all("(2 frames, the bright square in frame 0" in _line(out, f"req{i}") for i in range(5))


def test_the_frames_reach_the_output(capsys):
    """Two seeds give two sets of frames (and random weights): the generations differ; one seed
    twice gives the same."""
    def run(seed: int) -> list[int]:
        assert cli.main(["generate", "--random-weights", "--multimodal", "--frames", "2",
                         "--prompt", "hi", "--seed", str(seed), "--max-new-tokens", "4", *SMALL]) == 0
        return _tokens(capsys.readouterr().out)

    assert run(0) == run(0) != run(1)


@pytest.mark.parametrize("extra, message", [
    pytest.param(["--frames", "4"], "--frames 4: needs --multimodal", id="frames-alone"),
    # an id without the checkout's path: the item universe is the same on every machine
    pytest.param(["--vision", str(VISION)], f"--vision {VISION}: needs --multimodal",
                 id="vision-alone"),
    pytest.param(["--multimodal", "--frames", "3"],
                 "--frames 3: the tiny model's vision tower takes 2, 4, 6 or 8 frames a request",
                 id="odd-frames"),
    pytest.param(["--multimodal", "--frames", "10"],
                 "--frames 10: the tiny model's vision tower takes", id="too-many-frames"),
    pytest.param(["--multimodal", "--vision", "absent.safetensors"],
                 "--vision absent.safetensors: no such file", id="vision-missing"),
    pytest.param(["--multimodal", "--frames", "2", "--draft-length", "2"],
                 "multimodal_without_speculation", id="with-speculation"),
])
def test_an_inconsistent_video_request_is_refused_naming_the_option(extra, message, capsys):
    assert cli.main(["generate", "--random-weights", "--prompt", "a", *SMALL, *extra]) == 2
    out = capsys.readouterr().out
    assert message in out and "req0" not in out, out


def test_a_vision_file_that_is_no_tower_and_a_checkpoint_without_one_are_refused(tmp_path, capsys):
    plain = _random_checkpoint(tmp_path)
    argv = ["generate", "--multimodal", "--frames", "2", "--prompt", "a", *SMALL]
    assert cli.main(argv + ["--checkpoint", str(plain)]) == 2
    out = capsys.readouterr().out
    assert f"no vision tower beside --checkpoint {plain}" in out and "--vision FILE" in out, out
    assert cli.main(argv + ["--checkpoint", str(plain), "--vision", str(plain)]) == 2
    out = capsys.readouterr().out
    assert "not a vision tower file" in out and "--vision takes a vision tower file" in out, out
    assert "Traceback" not in out
