//! Do-not-contact: per workspace (a Slack team or a chat tenant), people no agent may DM or
//! @mention. The lists are configuration in the log, so replay sees the list every send was
//! judged under and instances with different files cannot disagree silently. The check runs on
//! every send, ask and file before the hold, on the recipients the post would reach — the DM's
//! other member (the person who writes in it, as the fold observed) and the user ids the
//! runtime declares its draft @mentions — and never moves a cursor.
//!
//! It fails closed: a DM whose other member the fold has not seen cannot be checked
//! (`could_not_verify`), and a list in the log that does not validate refuses every send
//! (`bad_config`) until a valid one replaces it.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::intern::SurfaceKey;
use crate::proto;
use crate::state::State;
use crate::surface::SurfaceId;
use crate::verdict::refused;
use crate::verdict::{RefusalKind, Verdict};

/// Workspaces a configuration may list.
pub const WORKSPACES_MAX: usize = 1_000;
/// People one workspace's list may hold.
pub const USERS_PER_WORKSPACE_MAX: usize = 10_000;
/// Longest workspace or user id: Slack ids are about a dozen bytes, chat ids at most 96.
pub const ID_BYTES_MAX: usize = 96;
/// Mentions a send may declare.
pub const MENTIONS_MAX: usize = 100;

/// The do-not-contact configuration the fold decides by.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DoNotContact {
    /// Workspace id → the user ids nobody may contact there.
    pub lists: BTreeMap<String, BTreeSet<String>>,
    /// Why the newest configuration in the log was refused; while set, every send is refused.
    pub bad: Option<String>,
}

impl DoNotContact {
    /// The checked configuration, or what is wrong with it (naming the workspace and entry).
    pub fn from_proto(event: &proto::DoNotContactConfigured) -> Result<Self, String> {
        if event.lists.len() > WORKSPACES_MAX {
            return Err(format!("{} workspaces listed, more than {WORKSPACES_MAX}", event.lists.len()));
        }
        let mut lists = BTreeMap::new();
        for (index, list) in event.lists.iter().enumerate() {
            check_id(&list.workspace_id).map_err(|e| format!("list {index}: workspace id {e}"))?;
            if list.user_ids.len() > USERS_PER_WORKSPACE_MAX {
                return Err(format!(
                    "workspace {}: {} people listed, more than {USERS_PER_WORKSPACE_MAX}",
                    list.workspace_id,
                    list.user_ids.len()
                ));
            }
            let mut users = BTreeSet::new();
            for (entry, user) in list.user_ids.iter().enumerate() {
                check_id(user).map_err(|e| format!("workspace {}: entry {entry} {e}", list.workspace_id))?;
                users.insert(user.clone());
            }
            if lists.insert(list.workspace_id.clone(), users).is_some() {
                return Err(format!("workspace {} is listed twice", list.workspace_id));
            }
        }
        Ok(DoNotContact { lists, bad: None })
    }

    /// The stored form, workspaces and people in order (equal configurations encode equally).
    pub fn to_proto(&self) -> proto::DoNotContactConfigured {
        proto::DoNotContactConfigured {
            lists: self
                .lists
                .iter()
                .map(|(workspace, users)| proto::DoNotContactList {
                    workspace_id: workspace.clone(),
                    user_ids: users.iter().cloned().collect(),
                })
                .collect(),
        }
    }
}

/// An id on a list: 1..=[`ID_BYTES_MAX`] bytes, no whitespace or control characters.
fn check_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("is empty".into());
    }
    if id.len() > ID_BYTES_MAX {
        return Err(format!("is {} bytes, more than {ID_BYTES_MAX}", id.len()));
    }
    if id.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("contains whitespace or a control character".into());
    }
    Ok(())
}

/// Why a send was not allowed to reach its recipients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NotContactedReason {
    /// A recipient is on the workspace's list.
    Listed,
    /// The DM's other member is not known, so the list cannot be checked.
    CouldNotVerify,
    /// The list in the log does not validate.
    BadConfig,
}

impl NotContactedReason {
    pub fn as_str(self) -> &'static str {
        match self {
            NotContactedReason::Listed => "listed",
            NotContactedReason::CouldNotVerify => "could_not_verify",
            NotContactedReason::BadConfig => "bad_config",
        }
    }
}

/// A send refused by the do-not-contact check, with the facts it used.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotContacted {
    pub surface: SurfaceId,
    pub reason: NotContactedReason,
    /// The listed recipient (`listed` only).
    pub user_id: Option<String>,
    /// The DM's other member as the fold knew it (`None`: not a DM, or not seen yet).
    pub dm_member: Option<String>,
}

impl State {
    pub(crate) fn configure_do_not_contact(&mut self, event: &proto::DoNotContactConfigured) -> Verdict {
        match DoNotContact::from_proto(event) {
            Ok(config) => {
                self.do_not_contact.insert((), config);
                Verdict::Configured
            }
            Err(reason) => {
                // Fail closed: a list that cannot be read must not let sends through.
                self.do_not_contact.insert((), DoNotContact { lists: BTreeMap::new(), bad: Some(reason.clone()) });
                refused(RefusalKind::InvalidArgument, format!("doNotContact: {reason}"))
            }
        }
    }

    /// The do-not-contact configuration in the log (`None`: never configured).
    pub fn do_not_contact_config(&self) -> Option<&DoNotContact> {
        self.do_not_contact.get(&())
    }

    /// A person (not an agent, not a bot) wrote in a DM: they are its other member.
    pub(crate) fn note_dm_member(&mut self, dm: SurfaceKey, user_id: &str) {
        if user_id.is_empty() {
            return;
        }
        self.dm_members.ensure(crate::state::DM_MEMBERS_TAG, &dm, &self.cold);
        if self.dm_members.get(&dm).map(String::as_str) != Some(user_id) {
            self.dm_members.insert(dm, user_id.to_owned());
        }
    }

    /// The do-not-contact check of a send to `surface` declaring `mentioned` user ids: `None`
    /// lets the send on to the hold.
    pub(crate) fn check_do_not_contact(&self, surface: &SurfaceId, mentioned: &[String]) -> Option<NotContacted> {
        let config = self.do_not_contact_config()?;
        let refuse = |reason, user_id: Option<&str>, dm_member: Option<&String>| NotContacted {
            surface: surface.clone(),
            reason,
            user_id: user_id.map(str::to_owned),
            dm_member: dm_member.cloned(),
        };
        if config.bad.is_some() {
            return Some(refuse(NotContactedReason::BadConfig, None, None));
        }
        // Whether the post goes to one person; `None` when the fold cannot tell (a chat it never
        // saw a message of: only observations say whether a chat is p2p).
        let (workspace, direct) = match surface {
            SurfaceId::Slack { team, .. } => (team, Some(surface.is_slack_dm())),
            SurfaceId::Chat { tenant, .. } => {
                let top = self.surface_key(&surface.top_level());
                let kind = top.and_then(|k| self.chat_kinds.get_or_read(crate::state::CHAT_KINDS_TAG, &k, &self.cold));
                (tenant, kind.map(|kind| *kind == crate::surface::ChatKind::P2p))
            }
            SurfaceId::Linear { .. } | SurfaceId::Memory { .. } => return None,
        };
        let listed = config.lists.get(workspace.as_str()).filter(|users| !users.is_empty())?;
        let Some(direct) = direct else {
            return Some(refuse(NotContactedReason::CouldNotVerify, None, None));
        };
        let dm_member = if direct {
            self.surface_key(&surface.top_level())
                .and_then(|dm| self.dm_members.get_or_read(crate::state::DM_MEMBERS_TAG, &dm, &self.cold))
        } else {
            None
        };
        let dm_member = dm_member.as_deref();
        if let Some(user) = mentioned.iter().find(|user| listed.contains(*user)) {
            return Some(refuse(NotContactedReason::Listed, Some(user), dm_member));
        }
        if direct {
            match dm_member {
                None => return Some(refuse(NotContactedReason::CouldNotVerify, None, None)),
                Some(member) if listed.contains(member) => {
                    return Some(refuse(NotContactedReason::Listed, Some(member), Some(member)))
                }
                Some(_) => {}
            }
        }
        None
    }
}
