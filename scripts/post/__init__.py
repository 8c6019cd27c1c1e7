"""The request scripts: post one task to a running group and save its result."""
