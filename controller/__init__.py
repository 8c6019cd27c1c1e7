"""diffring controller: hosts the rings, the control channel and the HTTP front door."""
