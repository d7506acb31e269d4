"""rlkit: PPO fine-tuning of language models against a reward, every part a plugin."""

from importlib.metadata import PackageNotFoundError, version

from rlkit_core.hookspecs import hookimpl

try:
    __version__ = version("rlkit")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__", "hookimpl"]
