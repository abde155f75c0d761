"""Stand-ins and builders shared by the tests (one place, never copied between test modules)."""
