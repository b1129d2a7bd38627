"""A run's history rows: sent to experiment trackers, shown as terminal tables (`artrl history`)."""
