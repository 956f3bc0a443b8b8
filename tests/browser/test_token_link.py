"""Issue 54, hole 6: a ``#token=`` link (what ``make run`` prints) signs in only a tab that
has no session, and the tab says what happened: a link anyone can send must not swap a
signed-in person's session for a token its author chose."""

from __future__ import annotations

from playwright.sync_api import Browser, Page, expect

from pgsieve.platform.db import session_factory
from pgsieve.security.tokens import create_token
from tests.browser.live import TOKEN, LiveDeployment
from tests.browser.test_dashboard import login


def test_a_link_token_never_replaces_a_session(page: Page, live: LiveDeployment,
                                              browser: Browser):
    with session_factory(live.settings.effective_database_url)() as session:
        _, viewer = create_token(session, "on-call", "viewer")
    login(page, viewer)
    expect(page.get_by_role("link", name="Subscriptions")).to_be_visible()
    # a link carrying another (here: the admin) token, opened in the signed-in tab
    page.goto(f"/#token={TOKEN}&next=/audit")
    expect(page.get_by_test_id("notice")).to_contain_text("token in the link you opened "
                                                          "was ignored")
    assert TOKEN not in page.url
    # still the viewer: the audit log (admin) stays closed
    expect(page.get_by_role("alert")).to_contain_text("the audit log is for admin tokens")

    # a tab with no session takes it, and says so
    fresh = browser.new_context(base_url=live.url).new_page()
    try:
        fresh.goto(f"/#token={TOKEN}&next=/audit")
        expect(fresh.get_by_test_id("notice")).to_contain_text("Signed in with the token "
                                                               "from the link")
        expect(fresh.get_by_test_id("audit-more")).to_be_visible()
        assert TOKEN not in fresh.url
    finally:
        fresh.context.close()
