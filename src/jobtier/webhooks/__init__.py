"""Webhooks: the dispatcher (``dispatcher.py``) that turns transitions into signed HTTP
deliveries, the address policy that keeps them off internal networks (``safety.py``), the
Standard Webhooks signatures (``signing.py``) and the deliveries' store in Postgres."""
