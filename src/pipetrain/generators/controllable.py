"""Controllable-memory V schedules (V-Half, V-Min): less activation memory than ZB-V for some bubble."""
