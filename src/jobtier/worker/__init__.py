"""The worker side: tasks, their context, and the runtime that claims and runs jobs."""
