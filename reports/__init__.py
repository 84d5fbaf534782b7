"""Capacity-planning and run reports (HTML + Markdown); shows, never decides."""
