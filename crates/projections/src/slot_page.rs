//! Slot pages: how the checkpoint store packs the entries of the tables keyed by (owner, slot)
//! — the rows and the dedupe order of a surface, the settled-id order and the queued items of
//! an agent — into pages of [`SLOTS_PER_PAGE`] consecutive slots of one owner, one store entry
//! per page.
//!
//! The fold still writes and reads one entry per slot ([`crate::State::drain_changes`],
//! [`crate::cold::ColdStore`]): the packing is the store's, and it gives back exactly the
//! entries it was given. Why the store packs them: under `anima-load`'s mixed traffic the
//! checkpoint writes were about 4.8 store writes per event, and in sled each costs about 15,000
//! instructions, most of it splitting leaves (sled splits a leaf above 16 entries and rewrites
//! its parent whole). They were the largest single part of the engine's CPU (23%, more than
//! the fold). These four tables were 60% of those writes, and their new entries arrive in slot
//! order per owner, so a checkpoint's changes to one owner fall on a page or two. A changed
//! page is read, patched and written back: at most [`SLOTS_PER_PAGE`] entries per changed
//! page, whatever the history's length.
//!
//! Why 4 slots to a page: a page is rewritten whole, and queued wakes leave a queue from
//! anywhere in it (a claim takes a surface's items), so a checkpoint's changes to a queue are
//! scattered over its pages; and a surface's newest rows page is rewritten at every checkpoint
//! while it fills. With 64 slots, a count of one 30 s `anima-load` run's checkpoints gave 3.6
//! MB of page and entry bytes per checkpoint; with 16, 1.8 MB. With 16, in the second half of
//! a 90 s embedded `anima-load` run, the store took 449 MB of batches in 45 s (queued-item
//! pages 216 MB at 2.1 KB each, row pages 96 MB at 951 B); with 4, 259 MB (queued items 98 MB
//! at 486 B, rows 34 MB at 247 B), counted with `ANIMA_LOG=anima_engine::checkpoint=debug`.
//! Every byte of a batch goes through the store's journal and then its merges, which write
//! several times as much (with 16 slots, sampled each second through a 10-minute run, the
//! merge thread wrote 17–61 MB/s beside 6–13 MB/s of journal); those writes share the disk
//! with the embedded log's syncs. In two alternated pairs of 90 s
//! runs, 4 slots gave 0 and 109 calls of 100 ms or more against 2,512 and 274 with 16 (README,
//! "Slot pages of 4 slots").
//!
//! A page's key is its own tag (the entry tag with [`PAGE_TAG_BIT`] set), the owner's bytes as
//! in the entry key, and the page number (slot / [`SLOTS_PER_PAGE`], big-endian u64). Its value
//! is its entries in slot order: the slot's index in the page (one byte), the value's length
//! (LEB128) and the value.

/// Consecutive slots of one owner per page.
pub const SLOTS_PER_PAGE: u64 = 4;

/// Set in an entry tag to make the tag of its pages (no state tag has it set).
pub const PAGE_TAG_BIT: u8 = 0x40;

/// How a paged table's owner is encoded (postcard, as [`crate::state::tagged`] writes keys).
#[derive(Clone, Copy)]
enum Owner {
    /// A varint (an interned surface or agent key).
    Varint,
    /// A varint length and that many bytes (an agent id).
    Str,
}

/// How a paged table's slot is encoded.
#[derive(Clone, Copy)]
enum Slot {
    /// A varint.
    Varint,
    /// Eight bytes, big-endian (`u64::to_be_bytes`).
    BigEndian,
}

/// The paged tables: entry tag, owner encoding, slot encoding.
const PAGED: [(u8, Owner, Slot); 4] = [
    (crate::state::IDENTITY_ORDER_TAG, Owner::Varint, Slot::Varint),
    (crate::journal::JOURNAL_ROWS_TAG, Owner::Varint, Slot::Varint),
    (crate::state::SETTLED_ORDER_TAG, Owner::Varint, Slot::Varint),
    (crate::state::QUEUE_ITEMS_TAG, Owner::Str, Slot::BigEndian),
];

fn paged_table(entry_tag: u8) -> Option<(Owner, Slot)> {
    PAGED.iter().find(|(tag, _, _)| *tag == entry_tag).map(|&(_, owner, slot)| (owner, slot))
}

/// Whether `tag` is the tag of a paged table's pages.
pub fn is_page_tag(tag: u8) -> bool {
    tag & PAGE_TAG_BIT != 0 && paged_table(tag & !PAGE_TAG_BIT).is_some()
}

/// Where a state entry's key is stored: its page's key and its index in the page.
#[derive(Debug, PartialEq, Eq)]
pub struct PagedKey {
    pub page_key: Vec<u8>,
    pub index: u8,
}

/// The varint at the start of `bytes` and its length (prost's LEB128, as postcard writes it).
fn varint(bytes: &[u8]) -> Option<(u64, usize)> {
    let mut rest = bytes;
    let value = prost::encoding::decode_varint(&mut rest).ok()?;
    Some((value, bytes.len() - rest.len()))
}

/// The length of the owner at the start of `bytes`, if it is complete.
fn owner_len(owner: Owner, bytes: &[u8]) -> Option<usize> {
    match owner {
        Owner::Varint => varint(bytes).map(|(_, n)| n),
        Owner::Str => {
            let (len, n) = varint(bytes)?;
            let end = n.checked_add(usize::try_from(len).ok()?)?;
            (end <= bytes.len()).then_some(end)
        }
    }
}

fn decode_slot(slot: Slot, bytes: &[u8]) -> Option<u64> {
    match slot {
        Slot::Varint => varint(bytes).filter(|(_, n)| *n == bytes.len()).map(|(v, _)| v),
        Slot::BigEndian => bytes.try_into().ok().map(u64::from_be_bytes),
    }
}

fn encode_slot(slot: Slot, out: &mut Vec<u8>, value: u64) {
    match slot {
        Slot::BigEndian => out.extend_from_slice(&value.to_be_bytes()),
        Slot::Varint => prost::encoding::encode_varint(value, out),
    }
}

/// The page of the state entry `key` (table tag, then the postcard key), or `None` when its
/// table is not paged (or the key is not of the table's shape: then it is stored as itself,
/// on writes and reads alike).
pub fn paged_key(key: &[u8]) -> Option<PagedKey> {
    let (&tag, rest) = key.split_first()?;
    let (owner_codec, slot_codec) = paged_table(tag)?;
    let owner_len = owner_len(owner_codec, rest)?;
    let slot = decode_slot(slot_codec, &rest[owner_len..])?;
    let mut page_key = Vec::with_capacity(1 + owner_len + 8);
    page_key.push(tag | PAGE_TAG_BIT);
    page_key.extend_from_slice(&rest[..owner_len]);
    page_key.extend_from_slice(&(slot / SLOTS_PER_PAGE).to_be_bytes());
    Some(PagedKey { page_key, index: (slot % SLOTS_PER_PAGE) as u8 })
}

/// The page-key prefix to scan for the state entries whose keys start with `prefix`, when
/// they may be in pages: every page of the table, or of the owner when `prefix` names one
/// whole. Scanned pages hold a superset; filter their entries by `prefix`.
pub fn page_scan_prefixes(prefix: &[u8]) -> Vec<Vec<u8>> {
    let Some((&tag, rest)) = prefix.split_first() else {
        return PAGED.iter().map(|(tag, _, _)| vec![tag | PAGE_TAG_BIT]).collect();
    };
    let Some((owner_codec, _)) = paged_table(tag) else { return Vec::new() };
    let mut page_prefix = vec![tag | PAGE_TAG_BIT];
    if let Some(owner_len) = owner_len(owner_codec, rest) {
        page_prefix.extend_from_slice(&rest[..owner_len]);
    }
    vec![page_prefix]
}

/// A stored page that does not decode.
#[derive(Debug, thiserror::Error)]
#[error("a checkpoint page does not decode: {0}")]
pub struct PageError(&'static str);

/// The entries of an encoded page, as (index, value).
fn entries(page: &[u8]) -> Result<Vec<(u8, &[u8])>, PageError> {
    let mut out = Vec::new();
    let mut rest = page;
    while let Some((&index, after)) = rest.split_first() {
        let (len, n) = varint(after).ok_or(PageError("a value length is cut off"))?;
        let len = usize::try_from(len).map_err(|_| PageError("a value length is out of range"))?;
        let value = after.get(n..n.saturating_add(len)).ok_or(PageError("a value is cut off"))?;
        if u64::from(index) >= SLOTS_PER_PAGE || out.last().is_some_and(|(last, _)| *last >= index) {
            return Err(PageError("indexes are out of order or out of range"));
        }
        out.push((index, value));
        rest = &after[n + len..];
    }
    Ok(out)
}

/// The value at `index` of an encoded page.
pub fn page_get(page: &[u8], index: u8) -> Result<Option<Vec<u8>>, PageError> {
    Ok(entries(page)?.into_iter().find(|(i, _)| *i == index).map(|(_, value)| value.to_vec()))
}

/// Changes to one page, in order: (index in the page, the new value or `None`: removed).
pub type PageChanges<'a> = Vec<(u8, Option<&'a [u8]>)>;

/// The page `old` with `changes` applied in order (a value, or `None`: removed); `None` when
/// no entry is left.
pub fn page_apply(old: Option<&[u8]>, changes: &[(u8, Option<&[u8]>)]) -> Result<Option<Vec<u8>>, PageError> {
    let mut slots: [Option<&[u8]>; SLOTS_PER_PAGE as usize] = [None; SLOTS_PER_PAGE as usize];
    for (index, value) in entries(old.unwrap_or_default())? {
        slots[usize::from(index)] = Some(value);
    }
    for &(index, value) in changes {
        slots[usize::from(index)] = value;
    }
    let mut out = Vec::new();
    for (index, value) in slots.iter().enumerate() {
        if let Some(value) = value {
            out.push(index as u8);
            prost::encoding::encode_varint(value.len() as u64, &mut out);
            out.extend_from_slice(value);
        }
    }
    Ok((!out.is_empty()).then_some(out))
}

/// The state entries (entry key, value) of the page stored at `page_key`, in slot order (not
/// key-byte order where slots are varints: sort what a scan returns).
pub fn page_entries(page_key: &[u8], page: &[u8]) -> Result<crate::cold::Entries, PageError> {
    let (&page_tag, rest) = page_key.split_first().ok_or(PageError("an empty page key"))?;
    let tag = page_tag & !PAGE_TAG_BIT;
    let (_, slot_codec) = paged_table(tag).ok_or(PageError("not a page tag"))?;
    let owner_len = rest.len().checked_sub(8).ok_or(PageError("a page key is cut off"))?;
    let (owner, number) = rest.split_at(owner_len);
    let first = u64::from_be_bytes(number.try_into().expect("eight bytes")).saturating_mul(SLOTS_PER_PAGE);
    entries(page)?
        .into_iter()
        .map(|(index, value)| {
            let mut key = Vec::with_capacity(1 + owner.len() + 10);
            key.push(tag);
            key.extend_from_slice(owner);
            encode_slot(slot_codec, &mut key, first + u64::from(index));
            Ok((key, value.to_vec()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::tagged;
    use proptest::prelude::*;

    #[test]
    fn only_the_paged_tables_have_pages() {
        let row = tagged(crate::journal::JOURNAL_ROWS_TAG, &(7u32, 130u64));
        let paged = paged_key(&row).expect("rows are paged");
        assert_eq!(paged.index, (130 % SLOTS_PER_PAGE) as u8);
        assert!(is_page_tag(paged.page_key[0]));
        let identity = tagged(crate::state::IDENTITIES_TAG, &(7u32, "C1"));
        assert_eq!(paged_key(&identity), None);
        assert!(page_scan_prefixes(&identity[..1]).is_empty());
    }

    proptest! {
        /// Whatever is written through pages reads back as written, entry by entry and by any
        /// owner or table scan, with the entry keys the fold wrote.
        #[test]
        fn pages_give_back_the_entries_written(
            writes in proptest::collection::vec((0u32..3, 0u64..300, proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40))), 1..200),
            queue_owner in "[a-z]{0,3}",
        ) {
            let mut model = std::collections::BTreeMap::<Vec<u8>, Vec<u8>>::new();
            let mut store = std::collections::BTreeMap::<Vec<u8>, Vec<u8>>::new();
            for (owner, slot, value) in &writes {
                let keys = [
                    tagged(crate::journal::JOURNAL_ROWS_TAG, &(*owner, *slot)),
                    tagged(crate::state::QUEUE_ITEMS_TAG, &(format!("{queue_owner}{owner}"), slot.to_be_bytes())),
                ];
                for key in keys {
                    match value {
                        Some(v) => model.insert(key.clone(), v.clone()),
                        None => model.remove(&key),
                    };
                    let paged = paged_key(&key).expect("paged");
                    let old = store.get(&paged.page_key).cloned();
                    match page_apply(old.as_deref(), &[(paged.index, value.as_deref())]).unwrap() {
                        Some(page) => store.insert(paged.page_key, page),
                        None => store.remove(&paged.page_key),
                    };
                }
            }
            let mut read = std::collections::BTreeMap::new();
            for (page_key, page) in &store {
                for (key, value) in page_entries(page_key, page).unwrap() {
                    let paged = paged_key(&key).unwrap();
                    prop_assert_eq!(&paged.page_key, page_key);
                    prop_assert_eq!(page_get(page, paged.index).unwrap(), Some(value.clone()));
                    read.insert(key, value);
                }
            }
            prop_assert_eq!(&read, &model);
            for owner in 0u32..3 {
                let prefix = tagged(crate::journal::JOURNAL_ROWS_TAG, &owner);
                let scanned: std::collections::BTreeMap<_, _> = page_scan_prefixes(&prefix)
                    .iter()
                    .flat_map(|p| store.range(p.clone()..).take_while(move |(k, _)| k.starts_with(p)))
                    .flat_map(|(k, v)| page_entries(k, v).unwrap())
                    .filter(|(k, _)| k.starts_with(&prefix))
                    .collect();
                let expected: std::collections::BTreeMap<_, _> =
                    model.iter().filter(|(k, _)| k.starts_with(&prefix)).map(|(k, v)| (k.clone(), v.clone())).collect();
                prop_assert_eq!(scanned, expected);
            }
        }
    }

    #[test]
    fn a_damaged_page_is_an_error() {
        let page = page_apply(None, &[(1, Some(b"abc")), (3, Some(b""))]).unwrap().unwrap();
        assert_eq!(page_get(&page, 1).unwrap(), Some(b"abc".to_vec()));
        assert!(page_get(&page[..page.len() - 3], 1).is_err(), "a cut-off page");
        let mut swapped = page.clone();
        swapped[0] = 3;
        assert!(page_get(&swapped, 1).is_err(), "indexes out of order");
    }
}
