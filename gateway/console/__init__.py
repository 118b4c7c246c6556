"""The admin console: pages in the browser at /ui, over the admin and usage APIs (see routes.py)."""
