"""Service: the HTTP collector put together and served.

``app`` wires receivers → processors → spool → exporters and mounts the viewer; ``server`` runs it
under uvicorn with a draining shutdown; ``auth``, ``http_limits`` guard the routes and
connections; ``config_check`` turns settings errors into one clear line before start.
"""
