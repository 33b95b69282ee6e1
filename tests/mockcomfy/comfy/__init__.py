"""A stand-alone mock of the parts of ComfyUI's ``comfy`` package that
comfy-standin lives inside.

Written from a reading of Comfy-Org/ComfyUI at commit
02b2b3886164b1fa412d393a3ed0674b9d1cf010 (GPL); no upstream code is copied.
The modules reproduce the *behaviour* the stand-in depends on, driven by a
simulated device instead of torch.
"""
