"""rlkit's built-in plugins (installed as the package `rlkit_plugins`).

Each module registers its components through the `rlkit` entry-point group, exactly as a
third-party plugin does.
"""
