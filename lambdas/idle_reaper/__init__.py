"""idle-reaper: stop idle ML machines without ever killing a training run."""

__version__ = "0.1.0"
