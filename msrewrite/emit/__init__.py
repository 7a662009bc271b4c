"""The emitter: plans into edited source (codemods per mode, helpers, markers, schedules)."""
