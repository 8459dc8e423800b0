"""absl drivers for elsa: sweep (the main job), train, newton, benchmark."""
