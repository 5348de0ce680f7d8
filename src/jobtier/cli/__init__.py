"""The ``jobtier`` command."""
