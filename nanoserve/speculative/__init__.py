"""Speculative decoding: cheap drafts of a request's next tokens, verified in one step, changing no output.

config.py parses vLLM's `speculative_config`; ngram.py proposes drafts by prompt lookup; verify.py keeps the
drafted tokens a step's own sampling agrees with, and counts what was drafted and accepted.
"""

from nanoserve.speculative.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
