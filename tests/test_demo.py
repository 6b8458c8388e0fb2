"""`gradsync demo`, run as a real command: it trains, and its check catches a broken rank.

Each run uses small settings, a private daemon in a sandboxed TMPDIR (see
test_launch) and must leave nothing behind.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from test_launch import assert_private_daemon_gone, clean_env, run_cli, sandbox

from gradsync.client.cli.demo_rank import Progress, make_spiral, torch_available

__all__ = ["sandbox"]  # the fixture, imported for these tests

SMALL = ["demo", "--nproc", "2", "--epochs", "2", "--samples", "384", "--batch-size", "16",
         "--hidden", "32", "--bucket-kib", "2"]
IDENTICAL = "check: parameters identical on all 2 ranks: yes"
MATCHES = re.compile(r"check: equal to the same model trained in one process on the full "
                     r"32-sample batches: max abs difference (\S+) \(tolerance \S+\): yes")
HAS_TORCH = torch_available() is None


def demo_env(sandbox: dict[str, Path], **extra: str) -> dict[str, str]:
    # torch (its optimizers import dynamo) creates a cache folder in TMPDIR; keep TMPDIR for
    # what the demo itself leaves, which must be nothing.
    return clean_env(sandbox, TORCHINDUCTOR_CACHE_DIR=str(sandbox["marks"] / "inductor"),
                     **extra)


def assert_passes(result: object) -> str:
    stdout, stderr = result.stdout, result.stderr  # type: ignore[attr-defined]
    assert result.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"  # type: ignore[attr-defined]
    assert IDENTICAL in stdout
    match = MATCHES.search(stdout)
    assert match, stdout
    assert float(match.group(1)) < 1e-12
    assert "OK: data-parallel training through gradsync matches" in stdout
    assert re.search(r"time per step: [\d.]+ ms \(24 steps", stdout), stdout
    assert re.search(r"bytes synced: [\d.]+ KiB per rank \([\d.]+ KiB per step in [2-9] buckets",
                     stdout), stdout
    assert re.search(r"communication hidden behind backward: \d+%", stdout), stdout
    # Not a TTY: one line per epoch, no carriage returns.
    assert stdout.count("epoch ") == 2 and "\r" not in stdout
    assert "epoch 2/2 [########################] 12/12  loss" in stdout
    return str(stdout)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_demo_trains_with_torch_ddp_and_passes_its_check(sandbox: dict[str, Path]) -> None:
    result = run_cli(SMALL, demo_env(sandbox))
    stdout = assert_passes(result)
    assert "(gradsync DistributedDataParallel)" in stdout
    assert_private_daemon_gone(result.stderr, sandbox)


@pytest.mark.timeout(60)
def test_demo_numpy_path_passes_its_check(sandbox: dict[str, Path]) -> None:
    result = run_cli([*SMALL, "--backend", "numpy"], demo_env(sandbox))
    stdout = assert_passes(result)
    assert "numpy MLP 2-32-32-3 (GradientBucketer)" in stdout
    assert_private_daemon_gone(result.stderr, sandbox)


@pytest.mark.timeout(60)
def test_demo_without_torch_falls_back_to_numpy_and_says_so(sandbox: dict[str, Path]) -> None:
    shadow = sandbox["marks"] / "no-torch" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
    )
    env = demo_env(sandbox, PYTHONPATH=str(shadow.parent))
    result = run_cli([*SMALL, "--epochs", "1"], env)
    assert result.returncode == 0, result.stderr
    assert ("gradsync demo: torch is not installed: training a numpy MLP with "
            "GradientBucketer") in result.stdout
    assert IDENTICAL in result.stdout and MATCHES.search(result.stdout), result.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["auto", "numpy"])
def test_a_broken_rank_fails_the_check(sandbox: dict[str, Path], backend: str) -> None:
    result = run_cli([*SMALL, "--epochs", "1", "--backend", backend, "--_break"],
                     demo_env(sandbox))
    assert result.returncode == 1, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "check: parameters identical on all 2 ranks: NO (largest spread" in result.stdout
    assert "FAIL: the data-parallel model is not the single-process model" in result.stdout
    assert "OK:" not in result.stdout
    assert_private_daemon_gone(result.stderr, sandbox)


@pytest.mark.timeout(30)
def test_demo_refuses_bad_settings(sandbox: dict[str, Path]) -> None:
    result = run_cli(["demo", "--nproc", "4", "--samples", "100", "--batch-size", "32"],
                     demo_env(sandbox))
    assert result.returncode == 2
    assert "--samples 100 is fewer than one global batch (4 ranks x 32)" in result.stderr
    assert "started a private gradsyncd" not in result.stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.timeout(10)
def test_progress_redraws_on_a_terminal_and_prints_lines_otherwise() -> None:
    for stream in (_Terminal(), io.StringIO()):
        progress = Progress(stream, epochs=2, steps=4)
        progress.update(0, 2, 0.5, 0.25)
        progress.end_epoch(0, 0.4, 0.5, 1.0)
        text = stream.getvalue()
        final = "epoch 1/2 [########################] 4/4  loss 0.4000  acc  50.0%  1.00s\n"
        if stream.isatty():
            assert text.startswith("\repoch 1/2 [############............] 2/4  loss 0.5000")
            assert text.endswith("\r" + final)
        else:
            assert text == final


@pytest.mark.timeout(10)
def test_spiral_data_is_seeded_and_balanced() -> None:
    x, y = make_spiral(3, 300)
    again, labels = make_spiral(3, 300)
    assert x.shape == (300, 2) and x.dtype.name == "float64"
    assert (x == again).all() and (y == labels).all()
    assert sorted(set(y.tolist())) == [0, 1, 2] and (y == 0).sum() == 100
    assert not (make_spiral(4, 300)[0] == x).all()
