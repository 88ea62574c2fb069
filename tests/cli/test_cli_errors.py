"""One error format across the command line: every command's failure, a usage error
included, is one ``error:`` line on stderr with exit code 2, the underlying message
whole and its hint right; options say what they take (``--tp`` everywhere, a block in
bytes is ``--block-bytes``, metavars name their kind and list their choices); ``demo``
speaks JSON; ``inspect ls`` piped keeps every column whole."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from tiered_kv.cli import _load_commands, app

_load_commands()
runner = CliRunner()
BOX = re.compile("[\u2500-\u257f]")  # box-drawing characters


def _run(*args: str, **kw):
    return runner.invoke(app, list(args), env={"COLUMNS": "80"}, **kw)


def _one_error_line(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert not BOX.search(result.stderr) and "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize(
    "args, words",
    [
        (["inspect", "ls", "--no-such-option"], "No such option: --no-such-option"),
        (["inspect", "ls", "--limit", "many"], "Invalid value for '--limit'"),
        (["doctor", "--tp", "0"], "Invalid value for '--tp'"),
        (["config", "--preset"], "Option '--preset' requires an argument"),
        (["warmup", "prompts.jsonl"], "Missing option '--model'"),
        (["demo", "--requests", "x"], "Invalid value for '--requests'"),
        (["no-such-command"], "No such command 'no-such-command'"),
    ],
)
def test_usage_errors_are_one_line_without_a_box(args, words):
    line = _one_error_line(_run(*args))
    assert words in line


@pytest.mark.parametrize(
    "args, schema, words",
    [
        (["doctor", "--json", "--bogus"], "tiered-kv/doctor", "No such option: --bogus"),
        (["inspect", "ls", "/tmp", "--json", "--limit", "x"], "tiered-kv/inspect-ls", "Invalid value for '--limit'"),
        (["config", "--preset", "nope", "--json"], "tiered-kv/config", "--preset: no preset 'nope'"),
        (["config", "--json", "--preset", "llama-3.1-8b", "--cpu-bytes", "1Q"], "tiered-kv/config", "'1Q'"),
    ],
)
def test_with_json_every_error_is_a_json_document_on_stdout(args, schema, words):
    """A script that asked for ``--json`` reads an error from stdout too, usage errors
    and bad values included, as ``docs/cli.md`` promises."""
    result = _run(*args)
    line = _one_error_line(result)
    doc = json.loads(result.stdout)
    assert doc["schema"] == schema and words in doc["error"] and words in line


def test_command_errors_are_one_line_with_the_message_whole(tmp_path):
    line = _one_error_line(_run("demo", "--requests", "2", "--cpu-bytes", "lots"))
    assert "--cpu-bytes: cannot parse size 'lots'" in line and line.endswith("e.g. '64GiB'")
    (tmp_path / "file").write_text("x")
    # A cache directory the demo cannot make (under a file, as under a directory of another user).
    line = _one_error_line(_run("demo", "--requests", "2", "--cache-dir", str(tmp_path / "file" / "cache")))
    assert str(tmp_path / "file" / "cache") in line
    line = _one_error_line(_run("demo", "--layout", "sideways"))
    assert "Invalid value for '--layout'" in line and "'sideways' is not one of 'kv-first', 'kv-after'" in line
    line = _one_error_line(_run("config", "--layers", "32", "--kv-heads", "8"))
    assert "--head-dim: required without --model-config" in line


def test_demo_on_a_cache_it_may_not_write_is_one_error_line(tmp_path):
    """A directory this process cannot write, as another user's cache is: mode 0555, or
    for root (which ignores mode bits) a read-only tmpfs."""
    import os
    import subprocess

    path = tmp_path / "theirs"
    path.mkdir()
    if os.geteuid() == 0:
        mount = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=8m,ro,mode=0700", "tmpfs", str(path)], capture_output=True
        )
        if mount.returncode != 0:
            pytest.skip("cannot mount a read-only tmpfs here")
        undo = lambda: subprocess.run(["umount", "-l", str(path)], check=False)  # noqa: E731
    else:
        path.chmod(0o555)
        undo = lambda: path.chmod(0o755)  # noqa: E731
    try:
        line = _one_error_line(_run("demo", "--requests", "2", "--cache-dir", str(path)))
        assert f"disk_path {path} is not writable by this process" in line
        line = _one_error_line(_run("demo", "--requests", "2", "--cache-dir", str(path / "cache")))
        assert f"cannot create disk_path {path / 'cache'}" in line
    finally:
        undo()


def test_a_foreign_specs_key_gets_the_right_hint(tmp_path):
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"cpu_bytes_to_use": 1 << 30, "disk_path": str(tmp_path), "disk_bytes": "1GiB"}))
    result = _run("doctor", "--config", str(cfg), "--json", "--read-probe", "0")
    line = {c["name"]: c for c in json.loads(result.stdout)["checks"]}["config"]["message"]
    assert "cpu_bytes_to_use" in line and "did you mean" not in line and "TieringOffloadingSpec" in line


def test_a_block_in_bytes_is_block_bytes_and_its_hint_is_a_block_size(tmp_path):
    line = _one_error_line(_run("inspect", "bench", str(tmp_path), "--block-bytes", "3000"))
    assert "--block-bytes: '3000' has no unit" in line and "'3000KiB'" in line and "GiB" not in line
    line = _one_error_line(_run("inspect", "bench", str(tmp_path), "--block-size", "3000"))  # the old name
    assert "'3000KiB'" in line
    help_text = _run("inspect", "bench", "--help").stdout
    assert "--block-bytes SIZE" in help_text and "--block-size" not in help_text


def test_tp_is_tp_everywhere():
    for command in (["warmup"], ["config"], ["doctor"]):
        assert re.search(r"--tp N\b", _run(*command, "--help").stdout), command
    assert "--tp-size" not in _run("warmup", "--help").stdout
    # The old spelling is still taken.
    result = _run("warmup", "x.jsonl", "--model", "m", "--config", "/nonexistent.json", "--tp-size", "2")
    assert "No such option" not in result.output


@pytest.mark.parametrize(
    "command",
    [["demo"], ["config"], ["doctor"], ["warmup"], ["stats"]]
    + [["inspect", c] for c in ("summary", "ls", "verify", "evict", "clear", "bench")],
)
def test_metavars_name_their_kind_and_choices(command):
    text = _run(*command, "--help").stdout
    assert not BOX.search(text)
    text = text.split("Options:", 1)[1]  # arguments are named (PATH, PROMPTS) beside their type
    for vague in ("<bool>", "<str>", "<int>", "<path>", "<float>", " TEXT", " INTEGER", "<int range>", "<list["):
        assert vague not in text, (command, vague, text)


def test_choices_are_listed():
    assert "<kv-first|kv-after>" in _run("demo", "--help").stdout
    assert "<last-access|stored|hits|slot|hash|size>" in _run("inspect", "ls", "--help").stdout
    assert "<auto|kvikio|posix>" in _run("inspect", "bench", "--help").stdout


def test_demo_json_is_the_envelope(tmp_path):
    result = _run("demo", "--requests", "20", "--device", "cpu", "--cache-dir", str(tmp_path / "c"), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["schema"] == "tiered-kv/demo" and data["path"] == str(tmp_path / "c")
    assert data["mismatches"] == 0 and data["blocks_requested"] > 0
    assert set(data["hits_by_tier"]) == {"CPU", "DISK"} and data["transfers"]


def test_inspect_ls_piped_keeps_every_column_whole(tmp_path):
    assert _run("demo", "--requests", "30", "--device", "cpu", "--cache-dir", str(tmp_path / "c")).exit_code == 0
    full = json.loads(_run("inspect", "ls", str(tmp_path / "c"), "--json").stdout)["namespaces"][0]["entries"]
    # CliRunner's stdout is not a terminal, as in a pipe; 80 columns would cut this table.
    text = _run("inspect", "ls", str(tmp_path / "c")).stdout
    assert "last access" in text and "…" not in text
    rows = [ln for ln in text.splitlines() if ln.strip() and ln.split()[0] in {e["hash"][:16] for e in full}]
    assert len(rows) == min(len(full), 50)
    for row in rows:
        assert len(row.split()) >= 7, row


def test_a_tokenizer_error_is_whole(tmp_path):
    pytest.importorskip("transformers")
    from tiered_kv.cli.warmup import _load_tokenizer
    from tiered_kv.ops.warmup.errors import WarmupError

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(WarmupError) as err:
        _load_tokenizer(str(tmp_path / "tok"))
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "tok") in message and len(message.split(": ", 1)[1]) > 0


def test_a_config_file_too_large_to_be_one_is_refused_before_it_is_read_whole(tmp_path):
    """A server's config is a few KiB: a file of megabytes (a wrong path, a log) is one
    error line from every tool that reads configs, not a read of the whole file."""
    from tiered_kv.config_file import MAX_CONFIG_BYTES

    (tmp_path / "cache").mkdir()
    big = tmp_path / "big.json"
    big.write_text('{"cpu_bytes": "1GiB", "pad": "' + "x" * MAX_CONFIG_BYTES + '"}')
    for args in (
        ["doctor", "--config", str(big), "--read-probe", "0"],
        ["inspect", "summary", str(tmp_path / "cache"), "--config", str(big)],
    ):
        result = _run(*args)
        assert f"config {big}: larger than 1 MiB" in result.output, result.output
        assert "Traceback" not in result.output
