"""comfy_standin: stand-ins for subprocess-held models in ComfyUI."""

from . import _core  # noqa: F401

__version__ = "0.1.0"
