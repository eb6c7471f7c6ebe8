"""The daemon's two HTTP endpoints, as a client tells them apart.

Every reply of the worker endpoint (``[server] port``) and of the admin API (``[server]
admin_port``) carries :data:`ENDPOINT_HEADER` naming which one answered, so a client pointed at the
wrong port says so rather than guessing from a status code: a worker dialling the admin port gets a
401 there (the admin token guards it), which it would otherwise report as a wrong worker token.
"""

from __future__ import annotations

ENDPOINT_HEADER = "X-Hetd-Endpoint"
WORKER_ENDPOINT = "workers"
ADMIN_ENDPOINT = "admin"
ADMIN_REALM = 'realm="hetd-admin"'  # the admin API's WWW-Authenticate (also from older daemons)
