"""Programs that tests start as subprocesses (and import for their helpers); run them from the repo root."""
