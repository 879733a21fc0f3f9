"""The backend of a resident local engine, split along its jobs: prompts (tokenizing and checking them),
streams (fanning n choices out to the engine and merging their outputs), answers (tool calls and reasoning
in chat answers), echo and logprobs, finish reasons and canaries, first-token timing, usage totals."""

from edgeinfer.node.backends.local.backend import LocalBackend

__all__ = ["LocalBackend"]
