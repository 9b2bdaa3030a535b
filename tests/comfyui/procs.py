"""Process helpers shared by the ComfyUI suites."""

import subprocess


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    """Terminates `proc`, killing it if it has not exited after `grace_s` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
