"""Code the tests ship for the gateway to load as a process would: test-only engines (echo_engine)."""
