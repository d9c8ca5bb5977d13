"""The app's windows and widgets. They show state and emit the user's intents; `app.controller` acts."""
