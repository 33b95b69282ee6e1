"""standin-e2e-pack: the repository's own comfy-env pack for the tests
against ComfyUI itself (tests/test_comfyui_server.py).

A custom node as a comfy-env user writes one: comfy-env registers the
nodes of ``nodes/``, which run in the isolated environment that
``nodes/comfy-env.toml`` describes.
"""

from comfy_env import register_nodes

NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = register_nodes()
