"""One module per subcommand: validate inputs -> load -> work -> save -> finalize manifest."""
