"""Puts tests/ on the import path (pytest does so for a rootdir conftest), so test folders
share helpers such as serve_process.py."""
