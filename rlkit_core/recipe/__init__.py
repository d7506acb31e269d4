"""The recipe layer: a TOML recipe becomes checked objects (document, schema, registry of
plugins, the plan and its memory estimate, assembly of the components). Imports only the plugin API
(`rlkit_core`'s top-level modules)."""
