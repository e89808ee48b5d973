"""What the user is told about a plan: log lines and traces (``logs``), dump folders
(``dump``), and memory timelines drawn (``plotting``)."""
