"""Running untrusted code: the model's answers (the ``code`` task's reward) and the agents'
``python`` tool, each in a child process with limits and a filesystem view of its own.

``run`` starts and judges a run, ``fs`` builds the filesystem view, ``checks`` parses the
tests and reads back their values, ``runner`` is the script the child's interpreter runs.
Tasks and tools use it; it uses nothing of theirs.
"""

from disagg.sandbox.run import (SandboxResult, filesystem_isolation, filesystem_unavailable,
                                require_filesystem_isolation, run_python, run_snippet)

__all__ = ["SandboxResult", "filesystem_isolation", "filesystem_unavailable", "require_filesystem_isolation",
           "run_python", "run_snippet"]
