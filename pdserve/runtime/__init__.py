"""What every long-running pdserve process does the same way: its heap at start-up, stopping
background tasks, supervising background threads and tasks (``supervise``)."""
