python3 -m engine_manager doctor --json
