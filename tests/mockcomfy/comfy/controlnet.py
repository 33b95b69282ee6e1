"""Mock of the control-net / model-patch round trip over the loaded list.

``comfy/controlnet.py`` (~line 290) and ``comfy_extras/nodes_model_patch.py``
(three places) take ``loaded_models(only_currently_used=True)``, run a VAE
encode (which loads the VAE and may evict), then hand the same list back to
``load_models_gpu`` to restore what was in use. A model outside that list
is never reloaded by the round trip.
"""

from __future__ import annotations

from . import model_management as mm


def round_trip(encode=None):
    """Run the round trip; return the list that was handed back.

    ``encode`` is called between the two steps (load a VAE, free memory,
    anything an encode might do).
    """
    in_use = mm.loaded_models(only_currently_used=True)
    if encode is not None:
        encode()
    mm.load_models_gpu(in_use)
    return in_use
