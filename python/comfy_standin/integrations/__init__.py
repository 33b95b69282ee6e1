"""Opt-in adapters that put comfy_standin into the projects that host it."""
