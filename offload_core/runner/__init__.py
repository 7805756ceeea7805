"""The runner: settings → strategies → model and checkpoint → plan → dispatch → generate → report."""
