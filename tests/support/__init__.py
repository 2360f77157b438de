"""Helpers the test files share. A test file imports them from here, never from another test file
(pytest puts tests/ on sys.path, so `from support.served_route import Route`)."""
