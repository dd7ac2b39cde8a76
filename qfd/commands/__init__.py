"""CLI command modules. Each defines `register(app, subapps)` and imports nothing heavy at
module level (torch, transformers): import inside the command function instead."""
