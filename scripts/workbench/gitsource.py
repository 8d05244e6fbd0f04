"""A vLLM tree from a git repository at a ref: `make rebase-check VLLM_GIT=... VLLM_REF=...`.

The source is a URL or a local path; only the one commit is fetched
(`--depth 1`) into a scratch repository that is reused between runs, so a
second check of upstream's head fetches only what changed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .series import GIT_IDENTITY, SeriesError

# Seconds one git command may take. A URL may hang rather than fail (a
# host that drops packets, a stuck proxy, an askpass window nobody sees).
GIT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class GitCheckout:
    tree: Path
    source: str
    ref: str
    commit: str


def resolve_source(source: str) -> str:
    """A local path made absolute (the command runs from scripts/); a URL as given."""
    path = Path(source).expanduser()
    return str(path.resolve()) if path.exists() else source


def sanitized_ref(ref: str) -> str:
    """The ref as a file-name part: `feature/x` -> `feature-x`."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", ref).strip("-.") or "ref"


def _git(args: list[str], cwd: Path, timeout: float, doing: str) -> subprocess.CompletedProcess:
    """Run git, killing it and its helpers (ssh, https) if it takes over `timeout` seconds.

    `doing` names the work for the error, e.g. "fetching 'main' from URL".
    """
    env = dict(os.environ, **GIT_IDENTITY)
    # Its own session: no terminal for git or ssh to ask a password on (they
    # fail instead), and one process group to kill on timeout.
    proc = subprocess.Popen(["git", *args], cwd=cwd, env=env, text=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise SeriesError(f"{doing}: git {args[0]} took more than {timeout:g}s and was stopped; "
                          "check the source is reachable from here, "
                          "or give a local clone as VLLM_GIT") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _git_reason(stderr: str) -> str:
    """git's own one-line reason: its first `fatal:` or `error:` line, else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    fatal = [line for line in lines if line.startswith(("fatal:", "error:"))]
    if fatal:
        return fatal[0]
    return lines[-1] if lines else "git gave no message"


def _fetch_error(source: str, ref: str, stderr: str) -> SeriesError:
    reason = _git_reason(stderr)
    if "couldn't find remote ref" in stderr:
        return SeriesError(f"{source} has no ref {ref!r} ({reason}); give VLLM_REF as a branch, "
                           "a tag or a full 40-character commit sha")
    return SeriesError(f"cannot fetch {ref!r} from {source} ({reason}); check VLLM_GIT is a reachable "
                       "git URL or the path of a local git repository")


def _scratch_git(args: list[str], dest: Path, timeout: float, doing: str) -> subprocess.CompletedProcess:
    """A git command in the scratch repository that should not fail; if it does, start it anew."""
    done = _git(args, dest, timeout, doing)
    if done.returncode != 0:
        raise SeriesError(f"{doing}: git {' '.join(args)} in {dest} failed ({_git_reason(done.stderr)}); "
                          f"delete {dest} and run again")
    return done


def _scratch_repo(path: Path, timeout: float) -> None:
    if (path / ".git").is_dir():
        return
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    _scratch_git(["init", "-q"], path, timeout, f"creating {path}")


def fetch_ref(source: str, ref: str, dest: Path, timeout: float = GIT_TIMEOUT_S) -> GitCheckout:
    """Check out `ref` of the repository at `source` as the work tree `dest`.

    Files left by an earlier check in `dest` are discarded.
    """
    source = resolve_source(source)
    _scratch_repo(dest, timeout)
    doing = f"fetching {ref!r} from {source}"
    # By URL, not a named remote: one scratch repository serves any source.
    # `--` so a source or ref that starts with `-` is not read as an option.
    fetched = _git(["fetch", "-q", "--depth", "1", "--no-tags", "--", source, ref], dest, timeout, doing)
    if fetched.returncode != 0:
        raise _fetch_error(source, ref, fetched.stderr)
    # A forced checkout and clean drop what the last check's patches changed.
    for args in (["checkout", "-q", "-f", "--detach", "FETCH_HEAD"], ["clean", "-q", "-f", "-d", "-x"]):
        _scratch_git(args, dest, timeout, f"checking out {ref!r} of {source}")
    commit = _scratch_git(["rev-parse", "FETCH_HEAD^{commit}"], dest, timeout, doing).stdout.strip()
    return GitCheckout(dest, source, ref, commit)
