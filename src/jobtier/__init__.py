"""jobtier: asynchronous jobs with a status tier served in milliseconds."""
