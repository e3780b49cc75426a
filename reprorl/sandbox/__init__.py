"""The sandbox: untrusted programs run isolated and under limits (`runner.run`), for code
rewards (`reprorl.data.code`) and the `python` tool (`reprorl.agent_loop.tools`)."""

from reprorl.sandbox.runner import (LANGUAGES, Limits, Result, SandboxError, python_argv, require_isolation, run,
                                    run_python)

__all__ = ["LANGUAGES", "Limits", "Result", "SandboxError", "python_argv", "require_isolation", "run", "run_python"]
